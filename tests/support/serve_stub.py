"""A tiny HTTP server standing in for a Ray head's Serve endpoints, reached through the fake API server's service proxy.

It answers what a Serve proxy and a Ray dashboard answer for the requests the provider
makes: ``GET /health``, ``POST /v1/chat/completions`` and ``GET /api/serve/applications/``
(Serve's own record of each application, settable by the test).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tests.support.threaded_app import ThreadedApp


class ServeStub(ThreadedApp):
    """An aiohttp server on 127.0.0.1 in its own thread; ``requests`` records ``(method, path, json)``."""

    def __init__(self) -> None:
        super().__init__()
        self.applications: dict[str, Any] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.chat_status = 200

    async def _health(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path, None))
        return web.json_response({"status": "ok"})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("POST", request.path, body))
        if self.chat_status != 200:
            return web.json_response({"error": "model not loaded"}, status=self.chat_status)
        content = f"echo: {body['messages'][-1]['content']}"
        return web.json_response({"object": "chat.completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

    async def _applications(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path, None))
        return web.json_response({"applications": self.applications, "proxies": {}})

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/api/serve/applications/", self._applications)
