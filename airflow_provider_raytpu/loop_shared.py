"""What every trigger on one event loop shares (the triggerer runs all its triggers on one loop).

Clients, watches and HTTP sessions are made once per event loop on first use, under a key
(e.g. the connection id), and closed when that loop ends: ``asyncio.run`` and the triggerer
cancel the tasks left on their loop before closing it, and a keeper task closes everything
here when it is cancelled. ``dag.test()`` runs each trigger in its own ``asyncio.run``, so each
gets its own set there, closed at its end. What exists per cluster (its HTTP session, its job
board) must not outlive its users in a triggerer that runs for weeks: it is held as a
:meth:`LoopShared.lease` and closed once its last holder has left (after ``linger`` seconds,
so that a follower's requests every few seconds reuse one session).

Nothing here blocks the loop; what is made is made by the caller's coroutine.

The first loop of a process also freezes what the process made before it (:func:`freeze_startup_heap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)

T = TypeVar("T")

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopShared] = weakref.WeakKeyDictionary()
_startup_frozen = False


def freeze_startup_heap() -> None:
    """Move every object the process made so far (Airflow, the imported modules: most of a triggerer's heap)
    into the garbage collector's permanent generation, once per process.

    Without it, the first full collection after a triggerer restart walks that whole heap while the loop
    waits: 214 ms with 1000 sensors starting at once (docs/benchmarks.md, ``triggerer_capacity``).
    Afterwards a full collection walks only what came later. Airflow's DAG processor does the same
    before it forks its parsers (``DagFileProcessorManager``: ``gc.freeze()``). Garbage that exists at
    this moment is kept: the startup's, made once.
    """
    global _startup_frozen
    if not _startup_frozen:
        _startup_frozen = True
        gc.freeze()


class LoopShared:
    """The shared objects of one event loop, each under a key.

    :param loop: the event loop they belong to.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._values: dict[Hashable, tuple[Any, float, Callable[[Any], Awaitable[None]] | None]] = {}
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._holders: dict[Hashable, int] = {}
        self._lingering: dict[Hashable, asyncio.TimerHandle] = {}
        self._releasing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._keeper = loop.create_task(self._keep(), name="raytpu-loop-shared")

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]],
                  close: Callable[[T], Awaitable[None]] | None = None, max_age: float | None = None) -> T:
        """The value under ``key``, made with ``make()`` by the first caller (the others wait for it).

        :param close: how to close the value when the loop ends or it is replaced.
        :param max_age: seconds after which the next caller makes a new value (the old one is closed).
        """
        found = self._fresh(key, max_age)
        if found is not None:
            return cast(T, found[0])
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            found = self._fresh(key, max_age)
            if found is not None:
                return cast(T, found[0])
            if self._closed:
                raise RuntimeError("the event loop's shared objects are closed")
            old = self._values.pop(key, None)
            value = await make()
            self._values[key] = (value, time.monotonic(), close)
        if old is not None:
            await _close(key, old[0], old[2])
        return value

    @contextlib.asynccontextmanager
    async def lease(self, key: Hashable, make: Callable[[], Awaitable[T]],
                    close: Callable[[T], Awaitable[None]] | None = None, linger: float = 0.0) -> AsyncIterator[T]:
        """The value under ``key`` (made by the first holder), held for the block; closed and forgotten once
        its last holder has left and ``linger`` seconds have passed without a new one.

        :param close: how to close the value.
        :param linger: seconds an unheld value is kept for the next holder.
        """
        value = await self.get(key, make, close)
        self._holders[key] = self._holders.get(key, 0) + 1
        if (timer := self._lingering.pop(key, None)) is not None:
            timer.cancel()
        try:
            yield value
        finally:
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                if linger <= 0:
                    await self.discard(key, value)
                else:
                    self._lingering[key] = asyncio.get_running_loop().call_later(linger, self._release, key, value)

    def _release(self, key: Hashable, value: Any) -> None:
        """An unheld value's linger is over: close it (in a task the loop keeps until it is done)."""
        self._lingering.pop(key, None)
        if not self._holders.get(key) and not self._closed:
            task = asyncio.get_running_loop().create_task(self.discard(key, value))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    def keys(self) -> list[Hashable]:
        """The keys of the values held now (for tests and diagnostics)."""
        return list(self._values)

    def peek(self, key: Hashable) -> Any | None:
        """The value under ``key`` if one was made, without making one."""
        entry = self._values.get(key)
        return None if entry is None else entry[0]

    async def discard(self, key: Hashable, value: Any = None) -> None:
        """Close and forget the value under ``key`` (only if it is ``value``, when given)."""
        entry = self._values.get(key)
        if entry is None or (value is not None and entry[0] is not value):
            return
        del self._values[key]
        if (lock := self._locks.get(key)) is not None and not lock.locked():
            del self._locks[key]
        await _close(key, entry[0], entry[2])

    def _fresh(self, key: Hashable, max_age: float | None) -> tuple[Any, float, Any] | None:
        entry = self._values.get(key)
        if entry is None or (max_age is not None and time.monotonic() - entry[1] > max_age):
            return None
        return entry

    async def aclose(self) -> None:
        """Close every value, newest first."""
        self._closed = True
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        while self._values:
            key, (value, _, close) = self._values.popitem()
            await _close(key, value, close)

    async def _keep(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await self.aclose()


async def _close(key: Hashable, value: Any, close: Callable[[Any], Awaitable[None]] | None) -> None:
    if close is None:
        return
    try:
        await close(value)
    except Exception:  # closing one thing must not keep the others open
        log.warning("Closing the shared %s failed", key, exc_info=True)


def loop_shared() -> LoopShared:
    """The running loop's shared objects (made on first use)."""
    loop = asyncio.get_running_loop()
    shared = _BY_LOOP.get(loop)
    if shared is None or shared._closed:
        freeze_startup_heap()
        shared = _BY_LOOP[loop] = LoopShared(loop)
    return shared


async def close_loop_shared() -> None:
    """Close the running loop's shared objects now (tests, and callers that end before their loop does)."""
    loop = asyncio.get_running_loop()
    shared = _BY_LOOP.pop(loop, None)
    if shared is not None:
        shared._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await shared._keeper
