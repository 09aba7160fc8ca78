"""The training job driver: its inputs, its import cost, the driver-side batch check, and the whole pipeline."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.workloads import storage
from airflow_provider_raytpu.workloads.preprocess import PreprocessSpec, run_preprocess
from airflow_provider_raytpu.workloads.result import last_result
from airflow_provider_raytpu.workloads.train import EXIT_BAD_INPUT, main, parse_args, scaling_config
from example_dags.pipeline.data import write_dataset
from tests.ray.workloads.ray_slice import REPO, SLICE, EmulatedSlice, driver_env
from tests.support.gcs import GcsStorage

WORKLOADS = ("batches", "checkpoints", "datasets", "loading", "preprocess", "result", "row_tally", "session", "storage",
             "train")


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO).stdout
    return set(out.split())


def test_the_driver_module_does_not_import_jax() -> None:
    modules = imported_after("import airflow_provider_raytpu.workloads.train")
    assert not {"jax", "jaxlib", "flax", "orbax", "optax", "airflow"} & {m.split(".")[0] for m in modules}


def test_no_workload_imports_airflow() -> None:
    modules = imported_after("\n".join(f"import airflow_provider_raytpu.workloads.{name}" for name in WORKLOADS))
    assert "airflow" not in {m.split(".")[0] for m in modules}


def test_workers_follow_from_the_slice_shape() -> None:
    spec = parse_args(
        ["--train-loop", "pkg.loop:fn", "--tpu", '{"accelerator": "v6e", "topology": "4x4", "num_slices": 2}',
         "--run-name", "r1", "--checkpoint-uri", "gs://bkt/runs", "--config", '{"lr": 0.1}',
         "--batch-size", "8", "--ragged-policy", "pad", "--max-failures", "3"]
    )
    assert spec.num_workers == 8  # 4 hosts of 4 chips per 4x4 slice, 2 slices
    config = scaling_config(spec.tpu)
    assert (config.use_tpu, config.topology, config.accelerator_type, config.num_workers) == (True, "4x4", "TPU-V6E", 8)
    assert spec.loop_config() == {
        "lr": 0.1, "checkpoint_uri": "gs://bkt/runs/r1/orbax", "run_name": "r1", "batch_size": 8,
        "ragged_policy": "pad",
    }
    assert spec.run_uri() == "gs://bkt/runs/r1" and spec.max_failures == 3
    assert config.resources_per_worker == {"CPU": 1, "TPU": 4.0}


@pytest.mark.parametrize(("chips_per_host", "workers", "chips"), [(None, 1, 8.0), (4, 2, 4.0)])
def test_each_worker_asks_for_its_hosts_chips(chips_per_host: int | None, workers: int, chips: float) -> None:
    """v6e 2x4: one 8-chip host, or (GKE's two ct6e-standard-4t) two 4-chip hosts; Ray alone assumes one."""
    config = scaling_config(TpuSlice("v6e", "2x4", chips_per_host=chips_per_host))
    assert (config.num_workers, config.resources_per_worker) == (workers, {"CPU": 1, "TPU": chips})


def test_a_slice_range_trains_elastically_on_whole_slices() -> None:
    args = ["--train-loop", "pkg.loop:fn", "--tpu", '{"accelerator": "v4", "topology": "2x2x2", "num_slices": 3}',
            "--run-name", "r1", "--checkpoint-uri", "gs://bkt/runs"]
    spec = parse_args([*args, "--slices", "1", "3", "--resize-interval", "5"])
    assert (spec.slices, spec.worker_counts, spec.num_workers) == ((1, 3), [2, 4, 6], 6)  # 2 hosts per slice
    config = scaling_config(spec.tpu, spec.slices, spec.resize_interval)
    assert config.elasticity_enabled and (config.min_workers, config.max_workers) == (2, 6)
    assert config.elastic_resize_monitor_interval_s == 5 and config.resources_per_worker == {"CPU": 1, "TPU": 4.0}
    assert not scaling_config(spec.tpu).elasticity_enabled
    with pytest.raises(ValueError, match=r"slices=\(1, 4\) must be \(min, max\) with 1 <= min <= max <= 3"):
        parse_args([*args, "--slices", "1", "4"])
    with pytest.raises(ValueError, match=r"slices=\(2, 1\)"):
        parse_args([*args, "--slices", "2", "1"])


def test_bad_inputs_fail_before_touching_ray(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--run-name", "r", "--checkpoint-uri", "/tmp/r", "--train-loop"]
    assert main([*common, "pkg.loop:fn", "--tpu", '{"accelerator": "v4", "topology": "4x4"}']) == EXIT_BAD_INPUT
    assert "v4 slices have 3 dimensions" in capsys.readouterr().err
    assert main([*common, "no_such_package.loop:fn", "--tpu", json.dumps(SLICE.to_dict())]) == EXIT_BAD_INPUT
    assert "cannot find module 'no_such_package.loop'" in capsys.readouterr().err
    bad_name = ["--run-name", "run[1]", "--checkpoint-uri", "/tmp/r", "--train-loop", "pkg.loop:fn"]
    assert main([*bad_name, "--tpu", json.dumps(SLICE.to_dict())]) == EXIT_BAD_INPUT
    assert "is not a valid run name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*common, "pkg.loop:fn", "--tpu", "{}", "--batch-size", "8"])  # policy missing


@pytest.fixture(scope="module")
def eval_parquet(ray_client: EmulatedSlice, fake_gcs: GcsStorage) -> str:
    """The pipeline's first two tasks: generate 1000 raw rows (JSONL in GCS), then normalise them to parquet."""
    raw = write_dataset(fake_gcs.uri("pipeline", "raw.jsonl"), 1000, seed=3, fmt="jsonl")
    output = fake_gcs.uri("pipeline", "clean")
    result = run_preprocess(PreprocessSpec(raw, output, "example_dags.pipeline.transforms:normalise", batch_size=250))
    assert result["rows_out"] == 1000
    return output


def train_args(run_name: str, runs_uri: str, eval_uri: str, policy: str) -> list[str]:
    return [
        sys.executable, "-m", "airflow_provider_raytpu.workloads.train",
        "--train-loop", "example_dags.pipeline.train_loop:train_loop_per_worker",
        "--tpu", json.dumps(SLICE.to_dict()), "--run-name", run_name, "--checkpoint-uri", runs_uri,
        "--config", json.dumps({"total_steps": 10, "checkpoint_every": 5, "eval_dataset": "eval"}),
        "--datasets", json.dumps({"eval": eval_uri}), "--batch-size", "64", "--ragged-policy", policy,
    ]


@pytest.mark.ray
def test_raise_policy_fails_on_the_driver_before_training(
    ray_slice: EmulatedSlice, fake_gcs: GcsStorage, eval_parquet: str
) -> None:
    runs = fake_gcs.uri("pipeline", "runs")
    job = subprocess.run(
        train_args("ragged", runs, eval_parquet, "raise"), cwd=REPO, env=driver_env(ray_slice),
        capture_output=True, text=True, timeout=300,
    )
    assert job.returncode == EXIT_BAD_INPUT, job.stderr[-3000:]
    assert "1000 rows" in job.stderr and "batch_size=64" in job.stderr and "2 workers" in job.stderr
    assert "ragged_policy='drop'" in job.stderr
    assert last_result(job.stdout) is None
    assert not storage.exists(f"{runs}/ragged")  # Ray Train never started a run


@pytest.mark.ray
def test_pipeline_trains_and_evaluates_every_row_once_with_padding(
    ray_slice: EmulatedSlice, fake_gcs: GcsStorage, eval_parquet: str
) -> None:
    runs = fake_gcs.uri("pipeline", "runs")
    job = subprocess.run(
        train_args("padded", runs, eval_parquet, "pad"), cwd=REPO, env=driver_env(ray_slice),
        capture_output=True, text=True, timeout=400,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    result = last_result(job.stdout)
    assert result is not None
    assert result["run_name"] == "padded" and result["steps"] == 10 and result["resumed_from_step"] is None
    assert result["checkpoint_uri"] == f"{runs}/padded/orbax/10"
    assert storage.exists(result["checkpoint_uri"] + "/commit_success.txt")
    metrics = result["metrics"]
    # 1000 rows over 2 workers = 500 each = 7 full batches of 64 + one of 52, padded and masked.
    assert metrics["eval_rows"] == 1000
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["holdout_loss"])
    assert metrics["step"] == 10 and metrics["checkpoint_uri"] == result["checkpoint_uri"]
