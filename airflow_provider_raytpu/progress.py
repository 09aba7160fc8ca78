"""Progress lines for task steps that wait: what is awaited, how it stands, and for how long.

A task log must never go quiet for more than 10 s while a task waits (for processes or
pods to stop, a serving cluster to start, a Ray job to end). :func:`progress` covers a
blocking call that says nothing while it runs; :class:`LogPace` paces the lines of a
loop that polls on its own; :func:`with_pace` wakes a trigger whose watch is quiet.
Standard library only: operators, sensors and triggers all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class TaskLog(Protocol):
    """A task's logger: the standard library's, or the structlog logger Airflow gives a task as ``self.log``."""

    def info(self, msg: str, /, *args: Any) -> Any: ...

    def warning(self, msg: str, /, *args: Any) -> Any: ...

#: Seconds between progress lines: under 10 s, leaving room for the read that gives the detail.
PROGRESS_SECONDS = 8.0


class LogPace:
    """Says when a waiting loop should log again: when what it reports changed, or every ``every`` seconds.

    :param every: the longest silence, in seconds.
    :param clock: the clock (``time.monotonic``).
    """

    def __init__(self, every: float = PROGRESS_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.started = clock()
        self._last_time = self.started
        self._last_text = ""

    @property
    def elapsed(self) -> float:
        """Seconds since the wait began."""
        return self.clock() - self.started

    def due(self, text: str = "") -> bool:
        """Whether to log ``text`` now (it changed, or the last line is ``every`` seconds old); records it if so."""
        now = self.clock()
        if text == self._last_text and now - self._last_time < self.every:
            return False
        self._last_text, self._last_time = text, now
        return True

    def quiet(self) -> None:
        """Something else was just logged (or there is nothing to say yet): the next line is due
        ``every`` seconds from now."""
        self._last_time = self.clock()

    def seconds_left(self) -> float:
        """Seconds until a line is due even if nothing changes: how long a waiting loop may sleep."""
        return max(0.0, self.every - (self.clock() - self._last_time))


@contextlib.contextmanager
def progress(log: TaskLog, what: str, detail: Callable[[], str] | None = None,
             every: float = PROGRESS_SECONDS) -> Iterator[None]:
    """Log ``"<what>: <detail> (<n> s)"`` every ``every`` seconds while the block runs.

    For a call that blocks without saying anything (a local cluster stopping its processes,
    a promotion waiting for its serving cluster). The lines come from a thread on a fixed
    cadence; ``detail`` (optional, e.g. a status read) is read by another thread twice per
    line, so a slow read (a dashboard busy starting Serve) never delays a line: a line shows
    the latest detail read. A detail that fails is reported as unknown, never ends the task.

    :param log: the task's logger.
    :param what: what the block waits for, e.g. ``"Stopping RayCluster ml/train"``.
    :param detail: how it stands.
    :param every: seconds between lines.
    """
    started = time.monotonic()
    stop = threading.Event()
    latest: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                text = str(detail())  # type: ignore[misc]
            except Exception as exc:  # a progress read must not fail the task
                text = f"state unknown ({type(exc).__name__}: {exc})"
            latest[:] = [text]
            stop.wait(every / 2)

    def beat() -> None:
        lines = 0
        while not stop.wait(max(0.0, started + (lines + 1) * every - time.monotonic())):
            lines += 1
            log.info("%s (%.0f s)", f"{what}: {latest[0]}" if latest else what, time.monotonic() - started)

    threads = [threading.Thread(target=beat, name=f"progress: {what}", daemon=True)]
    if detail is not None:
        threads.append(threading.Thread(target=read, name=f"progress detail: {what}", daemon=True))
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(every)


async def with_pace(items: AsyncIterator[T], pace: LogPace) -> AsyncGenerator[T | None, None]:
    """Yield each item of ``items``, and ``None`` whenever ``pace`` comes due without one.

    For a watch that yields only on change: on ``None`` the consumer logs its progress (or
    calls :meth:`LogPace.quiet` when it has nothing to say yet). The pending read is not
    cancelled by a pace, only when the consumer stops.

    :param items: the async iterator to follow.
    :param pace: the consumer's pace.
    """
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=pace.seconds_left())
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
