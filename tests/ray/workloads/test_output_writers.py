"""Several runs writing one output at once, on local disk and on the fake GCS: each stages apart, one swaps at a
time, and a reader never sees two versions mixed.

The writers are threads (the swap's storage calls are what overlap) and, for a writer killed mid-swap, a
process killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from airflow_provider_raytpu.workloads import outputs, storage
from airflow_provider_raytpu.workloads.lease import OutputLease, OutputLeaseBusyError
from airflow_provider_raytpu.workloads.outputs import replace_output
from tests.ray.workloads.output_files import (  # noqa: F401  (output is a fixture)
    listed_rows,
    output,
    read_rows,
    rows_at,
    writer,
)

OWNER = json.dumps({"dag_id": "etl", "task_id": "clean", "map_index": -1})
REPO = Path(__file__).resolve().parents[3]


def attempt(run: str, try_number: int = 1) -> dict:
    return {"run_id": run, "try_number": try_number}


def version_rows(number: int) -> list[int]:
    """The rows version ``number`` writes: ten of its own."""
    return list(range(number * 10, number * 10 + 10))


def test_two_runs_writing_at_once_each_commit_whole_and_never_delete_each_others_staging(output: str) -> None:
    """The reproduction: run B starting while run A writes used to clear A's files from their shared staging;
    A then committed a mix of both runs' rows and B failed."""
    both_writing = threading.Barrier(2, timeout=30)
    results: dict[str, tuple[storage.Location, str]] = {}

    def run(name: str, rows: list[int]) -> None:
        write = writer(rows)

        def write_while_the_other_writes(at: storage.Location) -> None:
            both_writing.wait()  # both have staged their record, neither has written its files
            write(at)
            both_writing.wait()  # both have written, neither has swapped
        results[name] = replace_output(output, OWNER, write_while_the_other_writes, attempt(name))

    threads = [threading.Thread(target=run, args=(name, rows)) for name, rows in
               (("runA", version_rows(1)), ("runB", version_rows(2)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert set(results) == {"runA", "runB"}, "both runs succeeded"
    record = outputs.read_record(storage.resolve(output))
    last = next(name for name, (_, version) in results.items() if version == record.version)
    assert listed_rows(output) == rows_at(output) == version_rows(1 if last == "runA" else 2), (
        "the output holds exactly the last run's rows, all of them")
    assert record.writer["run_id"] == last and not record.pending and not record.superseded
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == []


def test_a_reader_racing_fifty_swaps_never_reads_a_mix(output: str) -> None:
    """Through the record (the provider's readers) every read is one whole version, or fails because a later
    swap removed a file it listed; through ``_SUCCESS`` (readers outside the provider), a read with the same
    marker before and after is one whole version."""
    replace_output(output, OWNER, writer(version_rows(0)), attempt("run0"))
    location = storage.resolve(output)
    done = threading.Event()
    seen: Counter[str] = Counter()
    versions = {tuple(version_rows(number)) for number in range(51)}

    def swaps() -> None:
        try:
            for number in range(1, 51):
                replace_output(output, OWNER, writer(version_rows(number)), attempt(f"run{number}"))
        finally:
            done.set()

    swapper = threading.Thread(target=swaps)
    swapper.start()
    while not done.is_set():
        committed = outputs.committed_files(location)
        try:
            rows = read_rows(committed[0], location.filesystem)
        except (OSError, ValueError):  # pyarrow: ArrowInvalid (a ValueError) for an object deleted while read
            seen["record: a listed file removed by a later swap"] += 1
        else:
            assert tuple(rows) in versions, f"a read through the record mixed versions: {rows}"
            seen["record: one whole version"] += 1
        before = _success(location)
        try:
            rows = rows_at(output)
        except (OSError, ValueError):
            seen["_SUCCESS: a file removed while listed"] += 1
            continue
        if before is not None and before == _success(location):
            assert tuple(rows) in versions, f"a read between equal _SUCCESS markers mixed versions: {rows}"
            seen["_SUCCESS: one whole version"] += 1
        else:
            seen["_SUCCESS: absent or changed, read discarded"] += 1
    swapper.join()
    print(f"50 swaps raced: {dict(seen)}")
    assert seen["record: one whole version"] >= 10 and seen["_SUCCESS: one whole version"] >= 1
    assert listed_rows(output) == rows_at(output) == version_rows(50)


def _success(location: storage.Location) -> str | None:
    try:
        with location.filesystem.open_input_stream(location.child(outputs.SUCCESS_NAME).path) as stream:
            return json.loads(stream.read())["version"]
    except (FileNotFoundError, OSError):
        return None


def test_a_writer_waits_for_the_holder_naming_it_then_fails_with_a_retryable_error(output: str) -> None:
    replace_output(output, OWNER, writer(version_rows(1)), attempt("runA"))
    target = storage.resolve(output)
    holder = OutputLease(target, {**json.loads(OWNER), **attempt("scheduled__2026-12-01", 2)}, "", ttl=30)
    holder.acquire()
    lines: list[str] = []
    try:
        with pytest.raises(OutputLeaseBusyError, match=r"is being replaced by another writer \(DAG etl, task clean, "
                                                       r"run scheduled__2026-12-01, try 2\); waited 2 s"):
            replace_output(output, OWNER, writer(version_rows(2)), attempt("runB"), lease_wait=2,
                           progress=lines.append)
    finally:
        holder.release()
    assert lines and "DAG etl, task clean, run scheduled__2026-12-01, try 2 is replacing it" in lines[0]
    assert listed_rows(output) == rows_at(output) == version_rows(1), "the output is untouched"
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == [], "the waiting writer removed its own staging"
    replace_output(output, OWNER, writer(version_rows(2)), attempt("runB", 2))
    assert listed_rows(output) == version_rows(2), "free once released"


KILLED_MID_MOVE = """
import sys, time
from airflow_provider_raytpu.workloads import outputs
from tests.ray.workloads.output_files import writer
real_move_in = outputs._move_in
def move_in(source, target, names):
    real_move_in(source, target, names[:1])
    print("MOVED", flush=True)
    time.sleep(600)
outputs._move_in = move_in
outputs.replace_output(sys.argv[1], sys.argv[2], writer(list(range(100, 110))),
                       {"run_id": "runA", "try_number": 1}, lease_ttl=3)
"""


def test_a_holder_killed_mid_move_is_taken_over_and_the_output_ends_whole(output: str) -> None:
    replace_output(output, OWNER, writer(version_rows(1)), attempt("run0"))
    killed = subprocess.Popen([sys.executable, "-c", KILLED_MID_MOVE, output, OWNER], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert killed.stdout.readline().strip() == "MOVED"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    target = storage.resolve(output)
    record = outputs.read_record(target)
    assert record.pending and listed_rows(output) == version_rows(1), "killed before the commit: the old output"
    lease = json.loads(_lease_text(target))
    assert lease["holder"]["run_id"] == "runA" and not lease.get("released")

    lines: list[str] = []
    _, version = replace_output(output, OWNER, writer(version_rows(2)), attempt("runB"), lease_ttl=3, lease_wait=30,
                                progress=lines.append)
    assert listed_rows(output) == rows_at(output) == version_rows(2), "one complete version: the new writer's"
    record = outputs.read_record(target)
    assert (record.version, record.pending, record.superseded) == (version, [], [])
    assert any(line.startswith(f"Took over the lease on {target.uri} from DAG etl, task clean, run runA, try 1")
               for line in lines), lines
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == [], "the killed holder's staging was removed"
    assert _success(target) == version


def _lease_text(location: storage.Location) -> str:
    from airflow_provider_raytpu.workloads.lease import lease_object

    lease, _ = lease_object(location).read()
    return lease.to_json().decode()



def test_read_dataset_reads_the_committed_version_mid_swap(output: str, ray_client: object) -> None:
    """A swap stopped between moving the new files in and the commit: the prefix holds both versions, the record
    one; ``read_dataset`` (the provider's reader: preprocessing input, training datasets) reads the record's."""
    from airflow_provider_raytpu.workloads.datasets import read_dataset

    replace_output(output, OWNER, writer(version_rows(1)), attempt("run1"))
    target = storage.resolve(output)
    record = outputs.read_record(target)
    writer(version_rows(2))(target)  # moved in, not yet committed
    pending = [name for name in outputs.files_under(target) if name not in record.files]
    outputs.write_record(target, outputs.OutputRecord(record.owner, record.files, pending=pending,
                                                      version=record.version, writer=record.writer))
    assert rows_at(output) == sorted(version_rows(1) + version_rows(2)), "the prefix holds a mix"
    assert sorted(row["id"] for row in read_dataset(output).take_all()) == version_rows(1)
