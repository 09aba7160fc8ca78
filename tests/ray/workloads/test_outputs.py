"""An output a task owns, on local disk and on the fake GCS: replaced only by its own task, never losing a copy.

The writer here writes parquet files with pyarrow (what Ray Data's ``write_parquet`` does per
block); the crashes are exceptions raised at the step named, the process's state on disk
being what a killed process would leave.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_raytpu.workloads import outputs, storage
from airflow_provider_raytpu.workloads.outputs import RECORD_NAME, OutputNotOwnedError, replace_output
from airflow_provider_raytpu.workloads.uris import location_key, overlap
from tests.ray.workloads.output_files import listed_rows, output, parquet_bytes, rows_at, writer  # noqa: F401

OWNER = json.dumps({"dag_id": "etl", "task_id": "clean", "map_index": -1})


class Crash(Exception):
    """The process died here."""


def test_a_rerun_replaces_its_own_output_and_leaves_no_temporary_prefix(output: str) -> None:
    replace_output(output, OWNER, writer([1, 2, 3, 4]))
    first = storage.list_files(output)
    replace_output(output, OWNER, writer([5, 6, 7, 8]))
    assert rows_at(output) == [5, 6, 7, 8]
    assert not set(storage.list_files(output)) & {f for f in first if f.endswith(".parquet")}
    record = outputs.read_record(storage.resolve(output))
    assert (record.owner, len(record.files), record.pending, record.superseded) == (OWNER, 2, [], [])
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == []


def test_files_the_task_did_not_write_are_refused_and_kept(output: str) -> None:
    location = storage.resolve(output)
    storage.write_file(location.child("theirs.parquet"), parquet_bytes([100]))
    with pytest.raises(OutputNotOwnedError, match=r"holds 1 file\(s\) this task did not write \(theirs.parquet\); "
                                                  "nothing was deleted"):
        replace_output(output, OWNER, writer([1, 2]))
    assert rows_at(output) == [100]
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == [], "refused before anything was written"

    # Our own output with a file added to it afterwards: still refused, nothing deleted.
    storage.delete_prefix(output)
    replace_output(output, OWNER, writer([1, 2]))
    storage.write_file(location.child("added-later.parquet"), parquet_bytes([9]))
    with pytest.raises(OutputNotOwnedError, match="added-later.parquet"):
        replace_output(output, OWNER, writer([3, 4]))
    assert rows_at(output) == [1, 2, 9]


def test_another_tasks_output_is_refused(output: str) -> None:
    replace_output(output, OWNER, writer([1, 2]))
    other = json.dumps({"dag_id": "etl", "task_id": "clean", "map_index": 1})
    with pytest.raises(OutputNotOwnedError, match=r"is the output of another task \(.*\"map_index\": -1"):
        replace_output(output, other, writer([3, 4]))
    assert rows_at(output) == [1, 2]


@pytest.mark.parametrize("crash_at", ["moving the new files in", "the commit", "removing the old files"])
def test_a_crash_during_the_swap_loses_neither_copy_and_the_next_run_finishes(
        output: str, crash_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replace_output(output, OWNER, writer([1, 2, 3, 4]))
    location = storage.resolve(output)
    real_move_in, real_write_record, real_delete = outputs._move_in, outputs.write_record, outputs._delete

    def move_in(source: storage.Location, target: storage.Location, names: list[str]) -> None:
        if crash_at == "moving the new files in":
            real_move_in(source, target, names[:1])
            raise Crash(crash_at)
        real_move_in(source, target, names)

    def write_record(at: storage.Location, record: outputs.OutputRecord) -> None:
        if crash_at == "the commit" and record.superseded:
            raise Crash(crash_at)
        real_write_record(at, record)

    def delete(at: storage.Location, names: list[str]) -> None:
        removing_old = names not in ([], [outputs.SUCCESS_NAME]) and at.uri == location.uri
        if crash_at == "removing the old files" and removing_old:
            real_delete(at, names[:1])
            raise Crash(crash_at)
        real_delete(at, names)

    monkeypatch.setattr(outputs, "_move_in", move_in)
    monkeypatch.setattr(outputs, "write_record", write_record)
    monkeypatch.setattr(outputs, "_delete", delete)
    with pytest.raises(Crash):
        replace_output(output, OWNER, writer([5, 6, 7, 8]))
    monkeypatch.undo()

    record = outputs.read_record(location)
    if crash_at == "removing the old files":  # committed: the record lists the complete new copy
        assert listed_rows(output) == [5, 6, 7, 8]
    else:  # not committed: the record lists the complete old copy, the new files are pending
        assert listed_rows(output) == [1, 2, 3, 4]
        assert record.pending
        new_copy = sorted(rows_at(output) + rows_at(output + outputs.TEMP_SUFFIX))
        assert [r for r in new_copy if r > 4] == [5, 6, 7, 8], "the new copy is whole, in the output or beside it"

    replace_output(output, OWNER, writer([9, 10]))
    assert rows_at(output) == [9, 10], "the next run removed what the crash left, and only that"
    assert storage.list_files(output + outputs.TEMP_SUFFIX) == []


def test_an_empty_output_is_a_prefix_with_only_its_record(output: str) -> None:
    replace_output(output, OWNER, writer([1, 2]))
    replace_output(output, OWNER, lambda at: None)
    names = {Path(f).name for f in storage.list_files(output)}
    assert RECORD_NAME in names and names <= outputs.BOOKKEEPING
    replace_output(output, OWNER, writer([3, 4]))
    assert rows_at(output) == [3, 4]


@pytest.mark.parametrize(("first", "second", "how"), [
    ("gs://b/data", "gs://b/data/", "the same location"),
    ("gs://b//data/./x/..", "gs://b/data", "the same location"),
    ("gs://b/data/clean", "gs://b/data", "inside"),
    ("gs://b", "gs://b/data", "contains"),
    ("gs://b/data", "gs://b/data-clean", None),
    ("gs://b/data", "gs://c/data", None),
    ("~/data/out", "file://{home}/data", "inside"),
    ("/tmp/x/../data", "/tmp/data/", "the same location"),
    ("gs://b/data", "/b/data", None),
])
def test_overlap_after_normalising(first: str, second: str, how: str | None) -> None:
    second = second.replace("{home}", str(Path.home()))
    assert overlap(first, second) == how
    assert location_key("gs://b/a/") == ("gs", "b", "a")


def test_the_same_task_in_another_airflow_deployment_never_replaces_the_output(output: str) -> None:
    """Staging and prod writing one bucket: prod's run of the task is refused staging's output, nothing deleted;
    an output written before the deployment was recorded is refused, saying so."""
    staging, prod = ({**json.loads(OWNER), "deployment": name} for name in ("staging", "prod"))
    replace_output(output, json.dumps(staging, sort_keys=True), writer([1, 2]))
    with pytest.raises(OutputNotOwnedError, match=r"is the output of another task \(.*\"deployment\": \"staging\".*"
                                                  r"Give this task an output prefix of its own"):
        replace_output(output, json.dumps(prod, sort_keys=True), writer([3, 4]))
    assert listed_rows(output) == rows_at(output) == [1, 2]

    storage.delete_prefix(output)
    replace_output(output, OWNER, writer([5, 6]))  # an earlier release's owner: no deployment
    with pytest.raises(OutputNotOwnedError, match="written before this provider recorded the Airflow deployment"):
        replace_output(output, json.dumps(prod, sort_keys=True), writer([7, 8]))
    assert rows_at(output) == [5, 6]
