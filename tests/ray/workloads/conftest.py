"""Fixtures for the workloads of the ray tier: the fake GCS (``tests.support.gcs.fake_gcs``) and one emulated TPU slice.

Another tier gets the same fake GCS with ``from tests.support.gcs import fake_gcs`` in its conftest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.ray.workloads.ray_slice import SLICE, EmulatedSlice, worker_environment
from tests.support.gcs import GcsStorage, fake_gcs  # noqa: F401  (fake_gcs is a fixture)


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
