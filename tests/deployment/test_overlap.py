"""The overlap soak: a backfill of three dates of ``raytpu_overlap`` runs at once (``max_active_runs=3``), every
run writing one literal output and reading it through its record while the others replace it.

Invariants after the runs: the committed output is one run's rows, all of them, and its record names that run;
no reader saw a mix; no run's staging was removed by another (each run that succeeded wrote every row, and no
staging is left); every run succeeded, or failed with the named lease error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as pq
import pytest

from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.workloads import outputs, storage
from tests.deployment.dags.raytpu_overlap import DAG_ID, INPUT, OUTPUT, ROWS
from tests.deployment.deployment import AirflowDeployment, local_backend, wait_cluster_ready
from tests.deployment.rest import AirflowApi

CLUSTER = "overlap-ray"
DATES = ("2026-11-02T00:00:00Z", "2026-11-04T00:00:00Z")  # from, to: three logical dates


@pytest.fixture(scope="module")
def runs(deployment: AirflowDeployment, api: AirflowApi) -> Iterator[dict[str, dict[str, Any]]]:
    """The backfill's runs, once every one has ended: run id -> its state, its tasks' states, tries and XComs."""
    rows = "\n".join(json.dumps({"id": i, "text": f"row {i}"}) for i in range(ROWS)) + "\n"
    storage.write_file(storage.resolve(INPUT), rows.encode())
    backend = local_backend(deployment)
    backend.apply_cluster(build_ray_cluster(name=CLUSTER, namespace="default", tpu=TpuSlice("v4", "2x2x1")))
    try:
        wait_cluster_ready(api, backend, CLUSTER, "the overlap soak's Ray cluster ready")
        api.unpause(DAG_ID)
        api.backfill(DAG_ID, *DATES, max_active_runs=3)
        api.wait("the backfill's three runs", lambda: len(api.runs(DAG_ID)) >= 3, 120)
        ended = {run["dag_run_id"]: api.wait_run(DAG_ID, run["dag_run_id"], timeout=900) for run in api.runs(DAG_ID)}
        yield {run_id: {"state": state, **{task: _task(api, run_id, task) for task in ("write", "read")}}
               for run_id, state in ended.items()}
    finally:
        backend.delete_cluster(CLUSTER, "default")


def _task(api: AirflowApi, run_id: str, task_id: str) -> dict[str, Any]:
    ti = api.task(DAG_ID, run_id, task_id)
    log = "\n".join(api.log(DAG_ID, run_id, task_id, ti["try_number"])) if ti["try_number"] else ""
    result = api.xcom(DAG_ID, run_id, task_id) if ti["state"] == "success" else None
    return {"state": ti["state"], "try_number": ti["try_number"], "result": result, "log": log}


def test_overlapping_runs_commit_whole_versions_and_no_reader_sees_a_mix(runs: dict[str, dict[str, Any]]) -> None:
    writes = {run_id: run["write"] for run_id, run in runs.items()}
    reads = {run_id: run["read"]["result"] for run_id, run in runs.items()}
    # Every run succeeded, or failed with the named lease error (it waited for another run's swap too long).
    for run_id, write in writes.items():
        assert write["state"] == "success" or "OutputLeaseBusyError" in write["log"], (run_id, write["log"][-3000:])
    succeeded = {run_id: write["result"] for run_id, write in writes.items() if write["state"] == "success"}
    assert succeeded, "at least one run committed"
    # No run's staging was removed by another: each that succeeded wrote every row, and no staging is left.
    assert {result["rows_out"] for result in succeeded.values()} == {ROWS}
    location = storage.resolve(OUTPUT)
    staged = [f for f in storage.list_files(location.uri + outputs.TEMP_SUFFIX)]
    assert staged == [], staged
    # The committed output is one run's rows, all of them, and its record and _SUCCESS name that run's version.
    record = outputs.read_record(location)
    committed = pq.ParquetDataset([location.child(name).path for name in record.files],
                                  filesystem=location.filesystem).read(columns=["run"])
    assert set(committed.column("run").to_pylist()) == {record.writer["run_id"]} and committed.num_rows == ROWS
    assert succeeded[record.writer["run_id"]]["output_version"] == record.version
    files = [f for f in storage.list_files(OUTPUT) if f.endswith(".parquet")]
    assert len(files) == len(record.files), "the prefix holds the committed version only"
    # No reader saw a mix; together they read while the swaps happened.
    assert all(read is not None for read in reads.values()), {r: run["read"]["log"][-2000:] for r, run in runs.items()}
    assert sum(read["mixed_or_partial"] for read in reads.values()) == 0, reads
    total = {key: sum(read[key] for read in reads.values())
             for key in ("one_run_whole", "mixed_or_partial", "raced_a_swap", "nothing_yet")}
    print(f"\n[overlap soak] {len(runs)} runs, {len(succeeded)} committed, "
          f"{sum(w['try_number'] for w in writes.values())} write tries; reads: {total}; "
          f"runs seen by readers: {sorted({r for read in reads.values() for r in read['runs_seen']})}")
    assert total["one_run_whole"] >= 1
