"""Requests to a Serve service, one every 0.25 s in a thread, recording every answer's version and every
failure: the load a promotion must pass through without a failed request."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class RequestLoop:
    """Requests to the Serve service through the API server's service proxy, one every 0.25 s, until stopped."""

    def __init__(self, send: Callable[[], Any]) -> None:
        self._send = send
        self.versions: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="request-loop", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                answer = self._send()
                if answer.status == 200:
                    self.versions.append(answer.json()["version"])
                else:
                    self.failures.append(f"{answer.status}: {answer.text(300)}")
            except Exception as error:  # every failed request counts
                self.failures.append(repr(error))
            self._stop.wait(0.25)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)
