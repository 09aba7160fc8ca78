"""Fixtures for the workloads tier: the fake GCS (``tests.gcs.fake_gcs``) and one emulated TPU slice.

Another tier gets the same fake GCS with ``from tests.gcs import fake_gcs`` in its conftest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_raytpu.tpu import TpuSlice
from tests.gcs import GcsStorage, fake_gcs  # noqa: F401  (fake_gcs is a fixture)
from tests.workloads.ray_slice import EmulatedSlice

REPO = Path(__file__).resolve().parents[2]
SLICE = TpuSlice("v4", "2x2x2")  # 8 chips = 2 hosts of 4


def worker_environment(fake_gcs: GcsStorage) -> dict[str, str]:
    """Environment for Ray nodes and driver subprocesses: the emulator, the repo on the path, quick health checks."""
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **fake_gcs.env,
        "PYTHONPATH": python_path,
        # Ray Train notices a dead worker within half a second and registers the last report.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "JAX_PLATFORMS": "cpu",
        # No usage reporting, and no Ray Data poller querying a Prometheus that is not there.
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DATA_USAGE_DISABLED": "1",
    }


@pytest.fixture(scope="session")
def ray_slice(fake_gcs: GcsStorage) -> Iterator[EmulatedSlice]:
    """One emulated v4 2x2x2 slice (head + 2 hosts), started once for the tier.

    Job drivers run as their own processes and connect with ``RAY_ADDRESS``; a module
    that runs Ray Data in the test process itself asks for :func:`ray_client` too.
    """
    emulated = EmulatedSlice(SLICE, env=worker_environment(fake_gcs))
    emulated.start()
    try:
        yield emulated
    finally:
        emulated.shutdown()


@pytest.fixture(scope="module")
def ray_client(ray_slice: EmulatedSlice) -> Iterator[EmulatedSlice]:
    """This test process connected to the slice's cluster (explicit address) for one module."""
    import ray

    ray.init(address=ray_slice.address, log_to_driver=False)
    try:
        yield ray_slice
    finally:
        ray.shutdown()


def driver_env(ray_slice: EmulatedSlice) -> dict[str, str]:
    """Environment for a job driver subprocess: connect to the slice's cluster explicitly."""
    return {**os.environ, **ray_slice.env, "RAY_ADDRESS": ray_slice.address}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault-tolerance figures (wall time, steps lost) the tests attached to their reports."""
    lines = [
        json.dumps(value)
        for key in ("passed", "failed")
        for report in terminalreporter.stats.get(key, [])
        if getattr(report, "when", "") == "call"
        for name, value in getattr(report, "user_properties", [])
        if name == "fault_tolerance"
    ]
    if lines:
        terminalreporter.section("fault tolerance")
        for line in lines:
            terminalreporter.write_line(line)
