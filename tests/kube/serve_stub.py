"""A tiny HTTP server standing in for a Ray head's Serve endpoints, reached through the fake API server's service proxy.

It answers what a Serve proxy and a Ray dashboard answer for the requests the provider
makes: ``GET /health``, ``POST /v1/chat/completions`` and ``GET /api/serve/applications/``
(Serve's own record of each application, settable by the test).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class ServeStub:
    """An aiohttp server on 127.0.0.1 in its own thread; ``requests`` records ``(method, path, json)``."""

    def __init__(self) -> None:
        self.applications: dict[str, Any] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.chat_status = 200
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0

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

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/api/serve/applications/", self._applications)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def __enter__(self) -> ServeStub:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
