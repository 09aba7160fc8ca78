"""A trigger that measures the event loop it runs on (for ``triggerer_runner.py``).

It runs in Airflow's real trigger runner beside the triggers being measured: it sleeps 10 ms
at a time, records how late it woke, and fires when ``stop_file`` appears, with its samples
(time, lag), the garbage collections it saw and the runner process's RSS in the event.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

TICK = 0.01


class LoopLagProbe(BaseTrigger):
    """Samples the loop's lag until ``stop_file`` exists.

    :param stop_file: the path whose appearance ends the probe.
    """

    def __init__(self, stop_file: str) -> None:
        super().__init__()
        self.stop_file = stop_file

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"stop_file": self.stop_file}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import gc

        import psutil

        pauses: list[tuple[float, float, int]] = []
        started: list[float] = []

        def collected(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                pauses.append((time.time(), time.perf_counter() - started[0], info["generation"]))

        gc.callbacks.append(collected)
        samples: list[tuple[float, float]] = []
        rss: list[tuple[float, int]] = []
        process = psutil.Process()
        checked = 0.0
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK)
            now = time.time()
            samples.append((now, time.perf_counter() - t0 - TICK))
            if now - checked >= 0.5:
                checked = now
                rss.append((now, process.memory_info().rss))
                if os.path.exists(self.stop_file):
                    break
        gc.callbacks.remove(collected)
        yield TriggerEvent({"samples": samples, "rss": rss, "gc": pauses, "pid": os.getpid()})
