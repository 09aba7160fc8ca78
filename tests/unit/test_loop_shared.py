"""What one event loop's triggers share, and what the first of them does to the process."""

from __future__ import annotations

import subprocess
import sys

FIRST_LOOP = """
import asyncio, gc
import airflow_provider_raytpu.triggers.raycluster
from airflow_provider_raytpu.loop_shared import loop_shared

async def use() -> None:
    loop_shared()

before = gc.get_freeze_count()
asyncio.run(use())
first = gc.get_freeze_count()
asyncio.run(use())
print(before, first > 1000, gc.get_freeze_count() == first)
"""


def test_the_first_loop_freezes_what_the_process_made_before_it_once() -> None:
    """A triggerer restart's first full garbage collection walks only what its triggers made, not Airflow's
    whole heap (docs/benchmarks.md, triggerer_capacity: the loop's lag at a restart with 1000 sensors)."""
    out = subprocess.run([sys.executable, "-c", FIRST_LOOP], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "True", "True"]
