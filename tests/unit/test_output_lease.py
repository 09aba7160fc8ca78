"""The output lease on a local path: every change conditional on the version read, taken over only once expired.

The same lease on GCS (generation preconditions) and the swaps it guards are in the ray tier's
``tests/ray/workloads/test_output_writers.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from airflow_provider_raytpu.workloads.lease import (
    LeaseLostError,
    OutputLease,
    OutputLeaseBusyError,
    describe_holder,
    lease_object,
)
from airflow_provider_raytpu.workloads.storage import Location, resolve

HOLDER_A = {"dag_id": "etl", "task_id": "clean", "map_index": -1, "run_id": "runA", "try_number": 1}
HOLDER_B = {**HOLDER_A, "run_id": "runB"}


def test_a_held_lease_makes_the_next_writer_wait_then_fail_naming_the_holder(tmp_path: Path) -> None:
    output = resolve(str(tmp_path / "out"))
    first = OutputLease(output, HOLDER_A, "staging-a", ttl=30)
    assert first.acquire() is None, "nobody held it before"
    lines: list[str] = []
    second = OutputLease(output, HOLDER_B, "staging-b", ttl=30, wait=0.5, progress=lines.append)
    with pytest.raises(OutputLeaseBusyError, match=r"another writer \(DAG etl, task clean, run runA, try 1\)"):
        second.acquire()
    assert lines == [f"Waiting to replace {output.uri}: DAG etl, task clean, run runA, try 1 is replacing it "
                     "(its lease expires in 30 s unless renewed)"]
    first.release()
    previous = second.acquire()
    assert previous is not None and previous.released and previous.staging == "staging-a"
    second.release()


def test_an_expired_lease_is_taken_over_and_its_holder_can_no_longer_confirm(tmp_path: Path) -> None:
    output = resolve(str(tmp_path / "out"))
    stalled = OutputLease(output, HOLDER_A, "staging-a", ttl=0.6)
    stalled.acquire()
    stalled._stop.set()  # the holder stops renewing, as a killed or cut-off process does
    stalled._renewer.join()
    time.sleep(0.7)
    taker = OutputLease(output, HOLDER_B, "staging-b", ttl=30, wait=5)
    previous = taker.acquire()
    assert previous is not None and previous.holder == HOLDER_A and not previous.released
    with pytest.raises(LeaseLostError, match="expired .* and another writer took it over"):
        stalled.confirm()
    stalled.release()  # a lost lease is not given back: the taker still holds it
    current, _ = lease_object(output).read()
    assert current.holder == HOLDER_B and not current.released
    taker.confirm()
    taker.release()


def test_a_write_from_a_stale_version_conflicts(tmp_path: Path) -> None:
    output = resolve(str(tmp_path / "out"))
    holder = OutputLease(output, HOLDER_A, "staging-a", ttl=30)
    holder.acquire()
    store = lease_object(output)
    lease, version = store.read()
    store.write(lease, version)  # someone else's change in between
    with pytest.raises(LeaseLostError):
        holder.confirm()
    holder.release()


def test_a_renewing_holder_keeps_the_lease_past_its_ttl(tmp_path: Path) -> None:
    output = resolve(str(tmp_path / "out"))
    holder = OutputLease(output, HOLDER_A, "staging-a", ttl=0.6)
    holder.acquire()
    time.sleep(1.5)  # two and a half ttls: the background renewal kept it
    with pytest.raises(OutputLeaseBusyError):
        OutputLease(output, HOLDER_B, "staging-b", wait=0.3).acquire()
    holder.confirm()
    holder.release()


def test_describe_holder() -> None:
    assert describe_holder({**HOLDER_A, "map_index": 3}) == "DAG etl, task clean, run runA, try 1, map index 3"
    assert describe_holder({}) == "an unnamed writer"


def test_outputs_elsewhere_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="must be on GCS or a local path"):
        lease_object(Location("s3://bucket/out", pafs.LocalFileSystem(), "bucket/out"))
