"""Ray Data preprocessing and JaxTrainer training as Airflow tasks on an emulated slice, with GCS (fake-gcs-server).

Fault tolerance at the Airflow level: a Ray job that dies mid-training is resubmitted by
the Airflow retry and resumes from the latest orbax checkpoint in GCS, ending on the same
loss as an uninterrupted run. (A TPU host that dies, its slice recreated by the local
backend and Ray Train resuming within the same job: tests/ray/local_backend/test_multislice.py, on two
slices.)
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from ray.job_submission import JobSubmissionClient

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import CLUSTER_READY_TIMEOUT, EmulatedCluster, watch_until
from tests.support.airflow_runner import clear_task, rendered_fields, resume_dag_run, run_dag, task_instances
from tests.support.gcs import GcsStorage, fake_gcs  # noqa: F401  (fixture)
from tests.support.task_logs import LOADED_SILENCE_LIMIT_SECONDS, captured_output, problems, task_logs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

PIPELINE = Path(__file__).resolve().parents[3] / "example_dags" / "pipeline"
CONFIG = {"seed": 11, "total_steps": 30, "checkpoint_every": 5, "eval_dataset": "eval"}


@pytest.fixture(scope="module")
def emulated_cluster(local_backend: LocalBackend, fake_gcs: GcsStorage, raytpu_home: Path) -> Iterator[EmulatedCluster]:
    """A v6e 2x4 slice of two 4-chip hosts (GKE's two ct6e-standard-4t; Ray's own rule would assume one
    8-chip host) whose hosts reach the fake GCS, behind the ``raytpu_default`` connection."""
    import asyncio

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    patch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT",
                 json.dumps({"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
    manifest = build_ray_cluster(name="train", namespace="default", tpu=TpuSlice("v6e", "2x4", chips_per_host=4))
    result = local_backend.apply_cluster(manifest)
    try:  # a cluster that is not ready in time is deleted too: its raylets would slow every later test
        asyncio.run(watch_until(local_backend, "train", "default", lambda s: s.phase is Phase.READY,
                                CLUSTER_READY_TIMEOUT))
        yield EmulatedCluster("train", "default", manifest, result.action.value)
    finally:
        local_backend.delete_cluster("train", "default")
        patch.undo()


@pytest.fixture(scope="module")
def raw_data(fake_gcs: GcsStorage) -> str:
    import sys

    sys.path.insert(0, str(PIPELINE.parent))
    from pipeline.data import write_dataset

    return write_dataset(fake_gcs.uri("raw", "rows.jsonl"), 600, seed=3)


def pipeline_dag(dag_id: str, raw: str, out: str, checkpoints: str, retries: int = 0,
                 profile: tuple[int, int] | None = None) -> str:
    return f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.ray_data import RayDataOperator
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

ship = {{"py_modules": [{str(PIPELINE)!r}]}}
with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    prep = RayDataOperator(task_id="preprocess", cluster_name="train", input_uri={raw!r}, output_uri={out!r},
                           transform="pipeline.transforms:normalise", runtime_env=ship, poll_interval=0.5)
    train = JaxTrainerOperator(
        task_id="train", cluster_name="train", train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri={checkpoints!r}, config={CONFIG!r}, accelerator="v6e", topology="2x4", chips_per_host=4,
        datasets={{"eval": "{{{{ ti.xcom_pull('preprocess')['output_uri'] }}}}"}}, batch_size=32, ragged_policy="pad",
        runtime_env=ship, retries={retries}, retry_delay=0, deferrable=False, poll_interval=0.5,
        profile_steps={profile!r},
    )
    prep >> train
'''


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, airflow_home: Path, emulated_cluster: EmulatedCluster, raw_data: str,
              fake_gcs: GcsStorage) -> dict:
    """An uninterrupted pipeline run, steps 10 and 11 profiled: the figures the interrupted runs must match,
    and the task logs and links a user sees."""
    with captured_output(request.config) as logs:
        outcome = run_dag(airflow_home, pipeline_dag("pipeline_ok", raw_data, fake_gcs.uri("prep-ok"),
                                                     fake_gcs.uri("ckpt-ok"), profile=(10, 12)), "pipeline_ok")
    assert {t: o.state for t, o in outcome.items()} == {"preprocess": "success", "train": "success"}
    return {**{task: o.result for task, o in outcome.items()}, "logs": logs,
            "attempts": outcome["train"].xcoms.get("training_attempts"),
            "links": {task: o.links for task, o in outcome.items()}, "tasks": task_instances(outcome)}


def test_preprocess_then_train(reference: dict, fake_gcs: GcsStorage) -> None:
    prep, train = reference["preprocess"], reference["train"]
    assert (prep["rows_in"], prep["rows_out"]) == (600, 600)
    assert prep["output_uri"].startswith(f"gs://{fake_gcs.bucket}/prep-ok")
    assert train["steps"] == 30 and train["resumed_from_step"] is None
    assert train["metrics"]["eval_rows"] == 600
    assert (train["checkpoint_uri"].startswith(f"gs://{fake_gcs.bucket}/ckpt-ok/")
            and train["checkpoint_uri"].endswith("/30"))
    # What restarts cost, in its own XCom (the job's result is unchanged): none.
    assert reference["attempts"] == {"attempts": 1, "restarts": 0, "steps_lost": 0, "started_at_step": 0, "lost": []}
    # The literal URIs are the tasks' outlets; their asset events say what a downstream DAG needs.
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        extras = dict(session.execute(select(AssetEvent.source_task_id, AssetEvent.extra).where(
            AssetEvent.source_dag_id == "pipeline_ok")).all())
    assert extras["preprocess"] == {"rows_in": 600, "rows_out": 600, "output_uri": prep["output_uri"],
                                    "output_version": prep["output_version"]}
    assert extras["train"] == {"checkpoint_uri": train["checkpoint_uri"], "checkpoint_step": 30,
                               "run_name": train["run_name"], "training_attempts": reference["attempts"]}


def test_task_logs_read_cleanly(reference: dict) -> None:
    """No colour codes, no Ray INFO on stderr, each step once, never 10 s silent; each job task ends with its
    closing line, and training with its step times."""
    logs = reference["logs"]
    if not logs.out:
        pytest.skip("pytest does not capture output (-s): no task log to read")
    assert problems(logs.out, logs.err, reference["tasks"], limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    by_task = {log.task_id: log for log in task_logs(logs.out, reference["tasks"])}
    assert set(by_task) == {"preprocess", "train"}
    train = by_task["train"]
    steps = [line for line in train.ray_job_lines() if "train_loop: step " in line]
    assert [line.split("train_loop: ")[1].split(" loss")[0] for line in steps] == [
        "step 5", "step 10", "step 15", "step 20", "step 25"]
    assert not [line for line in train.ray_job_lines() if "Reporting training result" in line], \
        "Ray Train's per-worker report records stay in its worker log file"
    ours = [line.message for line in train.provider_lines()]
    assert ours[-4].startswith("Ray job raytpu-") and " SUCCEEDED after " in ours[-4] and "; returned {" in ours[-4]
    assert ours[-3].startswith("Profile of steps (10, 12): gs://")
    assert ours[-2].startswith("Step time: median ") and "over 30 steps on 2 workers" in ours[-2]
    assert ours[-1] == "Restarts: trained in one attempt, from step 0"
    prep = [line.message for line in by_task["preprocess"].provider_lines()]
    assert " SUCCEEDED after " in prep[-1] and '"rows_out": 600' in prep[-1]


def test_training_links_and_profile_trace(reference: dict, fake_gcs: GcsStorage) -> None:
    """Each worker's trace of steps 10-11 is in the run's storage in TensorBoard's profile layout; the task page
    links to the job, and (no console under the GCS emulator) shows the checkpoint and profile links disabled."""
    train = reference["train"]
    run = f"ckpt-ok/{train['run_name']}"
    assert train["profile_uri"] == f"gs://{fake_gcs.bucket}/{run}/profile"
    trace = f"{run}/profile/plugins/profile/steps-10-12/"
    files = sorted(name[len(trace):] for name in fake_gcs.objects(trace))
    assert {"worker-0.xplane.pb", "worker-1.xplane.pb"} <= set(files), files
    assert train["step_time"]["steps"] == 30 and train["step_time"]["workers"] == 2
    assert 0 < train["step_time"]["median_s"] <= train["step_time"]["p95_s"]
    links = reference["links"]["train"]
    assert set(links) == {"Ray job", "Checkpoints", "Profile"}
    assert links["Checkpoints"] is None and links["Profile"] is None
    job_page = links["Ray job"]
    assert job_page.startswith("http://127.0.0.1:") and "/#/jobs/raytpu-" in job_page
    assert requests.get(job_page.split("#")[0], timeout=30).status_code == 200


def latest_step(fake_gcs: GcsStorage, prefix: str) -> int:
    """The newest committed orbax step under a checkpoint prefix."""
    steps = [int(p.split("/orbax/")[1].split("/")[0]) for p in fake_gcs.objects(prefix)
             if "/orbax/" in p and p.split("/orbax/")[1].split("/")[0].isdigit() and "commit_success" in p]
    return max(steps, default=-1)


def run_with_fault(airflow_home: Path, dag_id: str, raw: str, fake_gcs: GcsStorage, fault,
                   retries: int) -> tuple[dict, int]:
    checkpoints = fake_gcs.uri(f"ckpt-{dag_id}")
    seen: dict[str, int] = {}

    def inject() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and latest_step(fake_gcs, checkpoints.split("/", 3)[3]) < 10:
            time.sleep(0.3)
        seen["step"] = latest_step(fake_gcs, checkpoints.split("/", 3)[3])
        fault()

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    outcome = run_dag(airflow_home, pipeline_dag(dag_id, raw, fake_gcs.uri(f"prep-{dag_id}"), checkpoints, retries),
                      dag_id)
    thread.join(5)
    assert outcome["train"].state == "success", outcome
    return {"result": outcome["train"].result, "try_number": outcome["train"].try_number,
            "attempts": outcome["train"].xcoms.get("training_attempts")}, seen["step"]


def test_dead_job_is_resubmitted_by_the_retry_and_resumes(airflow_home: Path, emulated_cluster: EmulatedCluster,
                                                          local_backend: LocalBackend, raw_data: str,
                                                          fake_gcs: GcsStorage, reference: dict) -> None:
    jobs = JobSubmissionClient(local_backend.dashboard("train", "default").url)

    def stop_training_job() -> None:
        (job,) = [j for j in jobs.list_jobs() if (j.metadata or {}).get("raytpu.dag_id") == "job_dies"
                  and j.metadata["raytpu.task_id"] == "train" and str(j.status) == "RUNNING"]
        jobs.stop_job(job.submission_id)

    started = time.monotonic()
    run, checkpointed = run_with_fault(airflow_home, "job_dies", raw_data, fake_gcs, stop_training_job, retries=1)
    result = run["result"]
    print(f"\n[fault] job dies: checkpoint at step {checkpointed} when stopped, resumed from "
          f"{result['resumed_from_step']}, {time.monotonic() - started:.0f} s")
    assert run["try_number"] == 2
    assert result["resumed_from_step"] >= checkpointed >= 10
    assert result["steps"] == 30
    # The retry's job resumed the run: one restart, which lost the steps the dead job did after its checkpoint.
    attempts = run["attempts"]
    assert (attempts["attempts"], attempts["restarts"], attempts["started_at_step"]) == (2, 1, 0)
    assert attempts["lost"][0]["resumed_from"] == result["resumed_from_step"]
    assert attempts["steps_lost"] == max(0, attempts["lost"][0]["reached"] - result["resumed_from_step"])
    assert abs(result["metrics"]["loss"] - reference["train"]["metrics"]["loss"]) <= 1e-6


def test_a_cleared_training_task_starts_over_and_its_config_stays_out_of_the_log(
        airflow_home: Path, emulated_cluster: EmulatedCluster, reference: dict, fake_gcs: GcsStorage,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A retry resumes; a user's Clear is a new cycle: a new Ray Train run from step 0, not the old
    run's checkpoint returned at once."""
    first = reference["train"]
    run_id = clear_task("pipeline_ok", "train")
    outcome = resume_dag_run(airflow_home / "dags" / "pipeline_ok.py", "pipeline_ok", run_id)["train"]
    assert (outcome.state, outcome.try_number) == ("success", 2)
    again = outcome.result
    assert again["run_name"] != first["run_name"] and again["run_name"].startswith("pipeline_ok.train-")
    assert again["resumed_from_step"] is None and again["steps"] == 30
    assert abs(again["metrics"]["loss"] - first["metrics"]["loss"]) <= 1e-6, "the same training, from step 0"
    # The submitted command is shown, its --config (which may hold secrets) by its keys only.
    log = capfd.readouterr().out
    shown = rendered_fields("pipeline_ok", "train")["entrypoint"]
    assert f"--run-name {again['run_name']}" in shown and "--tpu" in shown
    assert "--config '<JSON with keys: seed, total_steps, checkpoint_every, eval_dataset>'" in shown
    assert "Submitted Ray job raytpu-" in log and "<JSON with keys: seed, total_steps" in log
    assert '"checkpoint_every": 5' not in log and '"seed": 11' not in log



def test_a_train_loop_that_raises_fails_the_task_with_the_users_error_first(
        request: pytest.FixtureRequest, airflow_home: Path, emulated_cluster: EmulatedCluster,
        fake_gcs: GcsStorage) -> None:
    """A config the train loop cannot use (``learning_rate: "fast"``) fails it at step 0, on both workers, in
    both attempts Ray Train makes (``max_failures=1``). The task's error starts with the job's id and the
    loop's own exception and names where it was raised; the loop's traceback is in the log once (the driver's,
    without the provider's frames), each worker's and the controller's as their first and last lines; no
    escape codes anywhere."""
    dag = f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

with DAG("train_raises", schedule=None, start_date=datetime(2026, 1, 1)):
    JaxTrainerOperator(
        task_id="train", cluster_name="train", train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri={fake_gcs.uri("ckpt-raises")!r}, config={{"learning_rate": "fast", "total_steps": 4}},
        accelerator="v6e", topology="2x4", chips_per_host=4, runtime_env={{"py_modules": [{str(PIPELINE)!r}]}},
        max_failures=1, deferrable=False, poll_interval=0.5,
    )
'''
    with captured_output(request.config) as logs:
        outcome = run_dag(airflow_home, dag, "train_raises")["train"]
    assert (outcome.state, outcome.try_number) == ("failed", 1)
    if not logs.out:
        pytest.skip("pytest does not capture output (-s): no task log to read")
    log = logs.out + logs.err
    assert "\x1b" not in log
    error = re.search(r"AirflowException: (Ray job raytpu-\S+-try1 FAILED: .*)\n(.*)\n(.*)", log)
    assert error is not None, log[-3000:]
    assert error.group(1).endswith("FAILED: ValueError: could not convert string to float: 'fast'")
    assert error.group(2) == "  at pipeline/train_loop.py, line 101, in train"
    assert error.group(3).startswith("(its traceback ends the job's log above; Ray: Job entrypoint command failed")
    closing = next(line for line in log.splitlines() if "[error" in line and " FAILED after " in line)
    assert "ValueError: could not convert string to float: 'fast'" in closing
    assert log.count('optimizer = make_optimizer(float(config["learning_rate"]))') == 1
    job = [line.split("[ray job] ", 1)[1].split(" [airflow_provider_raytpu")[0].rstrip()
           for line in log.splitlines() if "[ray job] " in line]
    driver = [line for line in job if not line.startswith("(")]  # not a Ray actor's
    assert driver[-3:] == ["                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
                           "ValueError: could not convert string to float: 'fast'",
                           "error: training failed on ranks 0, 1"]
    assert '  File "pipeline/train_loop.py", line 101, in train' in driver and "run_user_loop" not in log
    actors = [line for line in job if line.startswith("(") and "Traceback (most recent call last)" in line]
    assert actors and all(line.endswith("(frames: in the Ray dashboard's job log)") for line in actors)


def training_dag(dag_id: str, checkpoints: str, seed: int) -> str:
    """One training task of 10 steps that resumes after a Clear (``resume_on_clear``)."""
    config = {"seed": seed, "total_steps": 10, "checkpoint_every": 5}
    return f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    JaxTrainerOperator(
        task_id="train", cluster_name="train", train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri={checkpoints!r}, config={config!r}, accelerator="v6e", topology="2x4", chips_per_host=4,
        runtime_env={{"py_modules": [{str(PIPELINE)!r}]}}, resume_on_clear=True, deferrable=False, poll_interval=0.5,
    )
'''


def test_a_run_resumes_only_its_own_checkpoints_and_only_under_its_config(
        request: pytest.FixtureRequest, airflow_home: Path, emulated_cluster: EmulatedCluster,
        fake_gcs: GcsStorage) -> None:
    """A Clear of the run resumes the run it trained (``resume_on_clear``), but not under a changed config: that
    fails without retries, naming what changed. The same DAG run deleted and created again (``dag.test()`` does
    that for a logical date it ran before, as the REST API's delete and a new trigger do) keeps its run id and
    is another run: it trains from step 0 under the new config, never resuming the deleted run's checkpoints."""
    from datetime import UTC, datetime

    checkpoints, day = fake_gcs.uri("ckpt-identity"), datetime(2026, 3, 1, tzinfo=UTC)
    first = run_dag(airflow_home, training_dag("identity", checkpoints, 11), "identity", logical_date=day)["train"]
    assert first.state == "success" and first.result["resumed_from_step"] is None, first

    changed = Path(airflow_home / "dags" / "identity.py")
    changed.write_text(training_dag("identity", checkpoints, 12))
    run_id = clear_task("identity", "train")
    with captured_output(request.config) as logs:
        refused = resume_dag_run(changed, "identity", run_id)["train"]
    assert (refused.state, refused.try_number) == ("failed", 2), "no retry: only the DAG's author can decide"
    if logs.out or logs.err:  # the cleared task went on with the run it trained: the same run name
        assert (f"training run {first.result['run_name']} " in logs.out + logs.err
                and "was started with another training config: config.seed changed" in logs.out + logs.err)

    again = run_dag(airflow_home, training_dag("identity", checkpoints, 12), "identity", logical_date=day)["train"]
    assert again.state == "success"
    assert again.result["run_name"] != first.result["run_name"] and again.result["resumed_from_step"] is None
