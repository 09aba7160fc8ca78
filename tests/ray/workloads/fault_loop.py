"""The example train loop with a test hook: pause once at a chosen step so a test can inject a fault there.

Config keys on top of the example's: ``pause_at_step`` and ``marker_dir`` (a local
directory shared with the test, which runs on the same machine). At that step, the
first time only, rank 0 writes ``<marker_dir>/paused-at-<step>`` and every worker
waits - until the test kills something, or ``<marker_dir>/release`` appears, or
``pause_timeout_s`` passes. After a restart the marker exists, so the resumed run
passes the step without stopping.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from example_dags.pipeline.train_loop import train


def pause_once(config: dict[str, Any]) -> Any:
    """An ``after_step`` hook implementing the pause described above."""
    pause_at = config.get("pause_at_step")
    marker_dir = Path(config.get("marker_dir", "/nonexistent"))
    timeout = float(config.get("pause_timeout_s", 300))

    def after_step(step: int, rank: int) -> None:
        if pause_at is None or step != int(pause_at):
            return
        marker = marker_dir / f"paused-at-{step}"
        if marker.exists():
            return  # resumed past the fault: keep going
        if rank == 0:
            marker.write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (marker_dir / "release").exists():
            time.sleep(0.1)

    return after_step


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The example loop, pausing once at ``pause_at_step``."""
    train(config, after_step=pause_once(config))
