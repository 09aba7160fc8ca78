"""An aiohttp application on 127.0.0.1, served from a thread and event loop of its own (test stand-ins
for a Ray head's HTTP endpoints)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class ThreadedApp:
    """Serves the routes :meth:`routes` adds while the ``with`` block lasts; ``url`` is its address."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def __enter__(self) -> Any:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=type(self).__name__, daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
