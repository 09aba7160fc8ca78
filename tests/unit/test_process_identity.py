"""Process identity in the local backend survives a wall-clock step (suspend/resume, a restored VM, NTP)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
import pytest

from airflow_provider_raytpu.backends.local.process import create_time_of, process_alive


@pytest.fixture
def clock_stepped_an_hour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """psutil reads a procfs whose boot time is an hour later, as after the wall clock stepped forward.

    The kernel keeps the boot time as wall clock minus uptime, so a clock step moves it; this
    process's own /proc entry is the real one.
    """
    pid = os.getpid()
    stat = Path("/proc/stat").read_text()
    (tmp_path / "stat").write_text(re.sub(r"^btime (\d+)$", lambda m: f"btime {int(m[1]) + 3600}", stat, flags=re.M))
    (tmp_path / str(pid)).symlink_to(f"/proc/{pid}")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    return pid


def test_a_recorded_process_is_still_itself_after_a_clock_step(clock_stepped_an_hour: int) -> None:
    pid = clock_stepped_an_hour
    with pytest.MonkeyPatch.context() as real:
        real.setattr(psutil, "PROCFS_PATH", "/proc")
        recorded = create_time_of(pid)
        wall_clock_before = psutil.Process(pid).create_time()
    assert psutil.Process(pid).create_time() - wall_clock_before == pytest.approx(3600)  # psutil sees the step
    assert create_time_of(pid) == pytest.approx(recorded, abs=0.01)
    assert process_alive(pid, recorded)


def test_a_different_start_is_still_a_different_process(clock_stepped_an_hour: int) -> None:
    recorded = create_time_of(clock_stepped_an_hour)
    assert recorded is not None
    assert not process_alive(clock_stepped_an_hour, recorded - 1.0)
