"""Multi-slice training on the local backend: two v4 2x2x2 slices (4 emulated hosts) with JaxTrainer.

One cluster for the module (a head and two slices of two hosts, 1 CPU each). The example train
loop runs through ``JaxTrainerOperator`` with a hook (``multislice_loop``) that records, at the first
step each worker runs, its slice, the ``MEGASCALE_*`` environment Ray Train sets per slice and the ids
of its data shard. An uninterrupted run shows one coordinator, slice ids 0 and 1 following the
workers' slices, and disjoint shards covering the dataset; then a host of slice 1 dies once a
checkpoint at step 10 or later is committed: the local backend recreates that slice, Ray Train
restarts every worker on both slices from the newest checkpoint, and the run ends on the
uninterrupted run's loss within 1e-6.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import CLUSTER_READY_TIMEOUT, watch_until
from tests.support.airflow_runner import run_dag
from tests.support.gcs import GcsStorage, fake_gcs  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
PIPELINE = HERE.parents[2] / "example_dags" / "pipeline"
LOOP = HERE / "multislice_loop"
ROWS = 400
STEPS, EVERY = 20, 5
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def two_slices(local_backend: LocalBackend, raytpu_home: Path) -> Iterator[str]:
    """``num_slices=2`` of v4 2x2x2 behind ``raytpu_default``; its name."""
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    patch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT",
                 json.dumps({"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
    local_backend.apply_cluster(build_ray_cluster(name="multi", namespace="default",
                                                  tpu=TpuSlice("v4", "2x2x2", num_slices=2)))
    try:  # a cluster that is not ready in time is deleted too: its raylets would slow every later test
        asyncio.run(watch_until(local_backend, "multi", "default", lambda s: s.phase is Phase.READY,
                                CLUSTER_READY_TIMEOUT))
        yield "multi"
    finally:
        local_backend.delete_cluster("multi", "default")
        patch.undo()


@pytest.fixture(scope="module")
def raw_rows(fake_gcs: GcsStorage) -> str:
    from example_dags.pipeline.data import write_dataset

    return write_dataset(fake_gcs.uri("multislice", "rows.jsonl"), ROWS, seed=5)


def train_dag(dag_id: str, checkpoints: str, rows: str, marker_dir: Path, more: str = "",
              step_seconds: float = 0.0) -> str:
    """:param step_seconds: each step at least this long (the loss is the same), so a fault lands mid-run."""
    config = {"seed": 3, "total_steps": STEPS, "checkpoint_every": EVERY, "marker_dir": str(marker_dir),
              "shard_dataset": "shards", "step_seconds": step_seconds}
    return f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    JaxTrainerOperator(
        task_id="train", cluster_name="multi", train_loop="multislice_loop:train_loop_per_worker",
        checkpoint_uri={checkpoints!r}, config={config!r}, datasets={{"shards": {rows!r}}},
        runtime_env={{"py_modules": [{str(PIPELINE)!r}, {str(LOOP)!r}]}},
        retries=0, deferrable=False, poll_interval=0.5, {more}
    )
'''


def records(marker_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(marker_dir.glob("rank*-step*.json"))]


def committed_step(fake_gcs: GcsStorage, prefix: str) -> int:
    steps = [int(p.split("/orbax/")[1].split("/")[0]) for p in fake_gcs.objects(prefix)
             if "/orbax/" in p and p.split("/orbax/")[1].split("/")[0].isdigit() and "commit_success" in p]
    return max(steps, default=-1)


@pytest.fixture(scope="module")
def uninterrupted(airflow_home: Path, two_slices: str, raw_rows: str, fake_gcs: GcsStorage,
                  tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    marker_dir = tmp_path_factory.mktemp("multislice-ok")
    outcome = run_dag(airflow_home, train_dag("multislice_ok", fake_gcs.uri("ckpt-multi-ok"), raw_rows, marker_dir),
                      "multislice_ok")
    assert outcome["train"].state == "success", outcome
    return {"result": outcome["train"].result, "records": records(marker_dir)}


def test_each_worker_sees_its_slice_in_the_megascale_environment_and_its_own_shard(uninterrupted: dict) -> None:
    result, seen = uninterrupted["result"], uninterrupted["records"]
    assert result["steps"] == STEPS and result["resumed_from_step"] is None
    assert sorted(r["rank"] for r in seen) == [0, 1, 2, 3] and {r["world_size"] for r in seen} == {4}
    assert {r["step"] for r in seen} == {1}
    # Ray Train's multi-slice environment: two slices, one coordinator, the slice id follows the worker's slice.
    assert {r["megascale"]["MEGASCALE_NUM_SLICES"] for r in seen} == {"2"}
    assert len({r["megascale"]["MEGASCALE_COORDINATOR_ADDRESS"] for r in seen}) == 1
    by_slice: dict[str, list[dict]] = {}
    for r in seen:
        by_slice.setdefault(r["slice"], []).append(r)
    assert sorted(by_slice) == ["multi-slice-0", "multi-slice-1"]
    assert [len(workers) for workers in by_slice.values()] == [2, 2]
    ids = {name: {r["megascale"]["MEGASCALE_SLICE_ID"] for r in workers} for name, workers in by_slice.items()}
    assert sorted(map(sorted, ids.values())) == [["0"], ["1"]], ids
    # Each worker trains on its own shard: disjoint, and together the whole dataset.
    shards = [set(r["ids"]) for r in seen]
    assert all(shards) and sum(len(s) for s in shards) == ROWS and set().union(*shards) == set(range(ROWS))


def test_a_lost_host_restarts_both_slices_from_the_checkpoint(
        airflow_home: Path, two_slices: str, raw_rows: str, fake_gcs: GcsStorage, local_backend: LocalBackend,
        uninterrupted: dict, tmp_path: Path) -> None:
    checkpoints = fake_gcs.uri("ckpt-multi-fault")
    seen: dict[str, int] = {}

    def kill_a_host_of_slice_1() -> None:
        deadline = time.monotonic() + 600
        # The first checkpoint: the most steps left for the loss to land in (a busy machine trains on meanwhile).
        while time.monotonic() < deadline and committed_step(fake_gcs, checkpoints.split("/", 3)[3]) < EVERY:
            time.sleep(0.3)
        seen["step"] = committed_step(fake_gcs, checkpoints.split("/", 3)[3])
        slice_1 = local_backend.state("multi", "default")["slices"][1]
        host = psutil.Process(next(h["pid"] for h in slice_1["hosts"] if h["worker_id"] == 1))
        raylet = next(p for p in host.children(recursive=True) if p.name() == "raylet")
        os.kill(raylet.pid, signal.SIGKILL)

    fault = threading.Thread(target=kill_a_host_of_slice_1, daemon=True)
    fault.start()
    # Steps of at least 0.3 s: on an idle machine the run committed its last checkpoint before the kill landed
    # (and resumed from step 20, with nothing left to train).
    outcome = run_dag(airflow_home, train_dag("multislice_fault", checkpoints, raw_rows, tmp_path, step_seconds=0.3),
                      "multislice_fault")
    fault.join(5)
    assert outcome["train"].state == "success", outcome
    result = outcome["train"].result
    print(f"\n[multi-slice] host of slice 1 killed with step {seen['step']} committed; "
          f"resumed from {result['resumed_from_step']}")
    assert outcome["train"].try_number == 1, "the job survived: Ray Train restarted the worker group"
    resumed = result["resumed_from_step"]
    assert resumed is not None and STEPS > resumed >= seen["step"] >= EVERY
    # Every worker of both slices started again at the step after the checkpoint.
    restarted = [r for r in records(tmp_path) if r["step"] == resumed + 1]
    assert sorted(r["rank"] for r in restarted) == [0, 1, 2, 3]
    assert sorted({r["slice"] for r in restarted}) == ["multi-slice-0", "multi-slice-1"]
    assert abs(result["metrics"]["loss"] - uninterrupted["result"]["metrics"]["loss"]) <= TOLERANCE
    slices = local_backend.state("multi", "default")["slices"]
    assert (slices[0]["restarts"], slices[1]["restarts"] >= 1) == (0, True), "only the lost slice was recreated"


def test_an_elastic_range_beyond_the_clusters_slices_fails_before_submitting(
        airflow_home: Path, two_slices: str, raw_rows: str, fake_gcs: GcsStorage, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    outcome = run_dag(airflow_home, train_dag("multislice_too_many", fake_gcs.uri("ckpt-multi-many"), raw_rows,
                                              tmp_path, more="elastic_slices=(1, 3),"), "multislice_too_many")
    assert (outcome["train"].state, outcome["train"].try_number) == ("failed", 1)
    assert ("elastic_slices=(1, 3): asks for up to 3 slices, but RayCluster default/multi has 2. Write "
            "elastic_slices=(1, 2)") in capfd.readouterr().out
    assert not list(tmp_path.iterdir()), "nothing trained"
