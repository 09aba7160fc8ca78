"""Holds an emulated cluster's nodes back until a test creates its gate file.

The deployment tier puts this directory on every component's ``PYTHONPATH``, so each Python
process the local backend starts imports this module first. A ``ray start`` process waits here
while its gate file is missing:

- ``RAYTPU_TEST_HOST_GATE=<file>``: the TPU hosts wait, the head starts (a node pool scaling up);
- ``RAYTPU_TEST_CLUSTER_GATE=<file>``: every node waits, the head too.

Any other process (Airflow's own, Ray's agents and workers) passes straight through.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def ray_start_arguments() -> list[str] | None:
    """This process's arguments when it is ``python -m ray.scripts.scripts start ...``, else ``None``."""
    try:
        argv = [arg.decode() for arg in Path("/proc/self/cmdline").read_bytes().split(b"\0") if arg]
    except OSError:
        return None
    if "ray.scripts.scripts" in argv and "start" in argv:
        return argv
    return None


def gate_for(argv: list[str]) -> Path | None:
    """The gate file this ``ray start`` waits for, if its environment names one."""
    cluster_gate = os.environ.get("RAYTPU_TEST_CLUSTER_GATE")
    if cluster_gate:
        return Path(cluster_gate)
    host_gate = os.environ.get("RAYTPU_TEST_HOST_GATE")
    if host_gate and "--head" not in argv:
        return Path(host_gate)
    return None


def wait_at_gate() -> None:
    argv = ray_start_arguments()
    gate = gate_for(argv) if argv is not None else None
    while gate is not None and not gate.exists():
        time.sleep(0.2)


wait_at_gate()
