"""One run of ``raytpu_jobs`` through what users do to it while it waits in the triggerer.

The steps are module fixtures, each building on the one before (any test can run alone):
trigger with conf choosing the slice -> the ready sensor defers while the TPU host is held back,
the triggerer crashes and a new one resumes the sensor -> ``hold_job`` is marked failed while its
Ray job runs -> the triggerer is restarted while ``count_job``'s Ray job runs, and it completes ->
``hold_job`` is cleared and reruns. ``count_job`` keeps the teardown from starting until the
test releases it, so the cluster is still there when the stopped job is looked at.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deployment.deployment import AirflowDeployment
from tests.deployment.rest import AirflowApi

DAG_ID = "raytpu_jobs"
#: What the jobs print from their environment: never to be seen on Airflow's side.
SECRET = "cred-" + uuid.uuid4().hex
TICK = re.compile(r"\btick (\d{4})\b")  # the job's own output, whatever prefix the task log adds
SHOWN_TOKEN = re.compile(r"\[ray job\] token ([^\s'\"]*)")  # the job's own line, as the task log shows it
RELEASED = re.compile(r"\breleased after \d+ ticks")  # its last line (the entrypoint shown has "{ticks}")


@dataclass
class JobsRun:
    run_id: str
    release_dir: Path
    host_gate: Path
    cluster: dict[str, Any]


@dataclass
class Handover:
    deferred: dict[str, Any]
    crashed_triggerer: int
    new_triggerer: int
    sensor: dict[str, Any]


@dataclass
class StoppedJob:
    submission_id: str
    ray_status: str
    task_state: str
    count_job_state: str


@dataclass
class RestartedJob:
    ticks_before_restart: int
    task: dict[str, Any]
    log: list[str]


@dataclass
class ClearedJob:
    cleared: list[str]
    run_state: str
    tries: list[dict[str, Any]]
    log: list[str]


def ray_jobs(cluster: dict[str, Any], task_id: str) -> list[dict[str, Any]]:
    """The cluster's Ray jobs submitted for ``task_id``, read from its dashboard's Jobs API."""
    jobs = httpx.get(f"{cluster['dashboard_url']}/api/jobs/", timeout=30).json()
    return [job for job in jobs if (job.get("metadata") or {}).get("raytpu.task_id") == task_id]


def deferred_on_a_triggerer(api: AirflowApi, run_id: str, task_id: str) -> dict[str, Any] | None:
    """The task instance once it is deferred and its trigger is assigned to a triggerer."""
    ti = api.task(DAG_ID, run_id, task_id)
    if ti["state"] in ("success", "failed", "upstream_failed"):
        raise AssertionError(f"{task_id} ended {ti['state']} instead of deferring\n{api.run_report(DAG_ID, run_id)}")
    return ti if ti["state"] == "deferred" and (ti["trigger"] or {}).get("triggerer_id") else None


def ticks(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := TICK.search(line))]


@pytest.fixture(scope="module")
def jobs_run(api: AirflowApi, tmp_path_factory: pytest.TempPathFactory) -> JobsRun:
    release_dir = tmp_path_factory.mktemp("release")
    host_gate = release_dir / "tpu-host-may-start"
    api.set_variable("job_credential", SECRET)
    api.unpause(DAG_ID)
    run_id = api.trigger(DAG_ID, {"accelerator": "v4", "topology": "2x2x1", "release_dir": str(release_dir),
                                  "host_gate": str(host_gate)})
    api.wait_task(DAG_ID, run_id, "create_cluster", ("success",), timeout=180)
    return JobsRun(run_id, release_dir, host_gate, api.xcom(DAG_ID, run_id, "create_cluster"))


@pytest.fixture(scope="module")
def sensor_handover(deployment: AirflowDeployment, api: AirflowApi, jobs_run: JobsRun) -> Handover:
    run_id = jobs_run.run_id
    deferred = api.wait("wait_ready deferred on a triggerer",
                        lambda: deferred_on_a_triggerer(api, run_id, "wait_ready"), 180)
    crashed = deferred["trigger"]["triggerer_id"]
    deployment.restart_triggerer(crash=True)
    handed_over = api.wait(
        "wait_ready's trigger on the new triggerer",
        lambda: (ti := deferred_on_a_triggerer(api, run_id, "wait_ready")) and
        ti["trigger"]["triggerer_id"] != crashed and ti,
        120,
    )
    jobs_run.host_gate.touch()
    sensor = api.wait_task(DAG_ID, run_id, "wait_ready", ("success",), timeout=240)
    return Handover(deferred, crashed, handed_over["trigger"]["triggerer_id"], sensor)


@pytest.fixture(scope="module")
def stopped_hold_job(api: AirflowApi, jobs_run: JobsRun, sensor_handover: Handover) -> StoppedJob:
    run_id, cluster = jobs_run.run_id, jobs_run.cluster
    api.wait("hold_job deferred on a triggerer", lambda: deferred_on_a_triggerer(api, run_id, "hold_job"), 180)
    running = api.wait("hold_job's Ray job running",
                       lambda: [j for j in ray_jobs(cluster, "hold_job") if j["status"] == "RUNNING"], 120)
    submission_id = running[0]["submission_id"]
    api.mark(DAG_ID, run_id, "hold_job", "failed")
    stopped = api.wait(f"Ray job {submission_id} to stop",
                       lambda: [j for j in ray_jobs(cluster, "hold_job")
                                if j["submission_id"] == submission_id and j["status"] not in ("PENDING", "RUNNING")],
                       90)
    return StoppedJob(submission_id, stopped[0]["status"], api.task(DAG_ID, run_id, "hold_job")["state"],
                      api.task(DAG_ID, run_id, "count_job")["state"])


@pytest.fixture(scope="module")
def restarted_count_job(deployment: AirflowDeployment, api: AirflowApi, jobs_run: JobsRun,
                        stopped_hold_job: StoppedJob) -> RestartedJob:
    run_id = jobs_run.run_id
    before = api.wait("count_job deferred with three ticks in its log",
                      lambda: deferred_on_a_triggerer(api, run_id, "count_job") and
                      (seen := ticks(api.log(DAG_ID, run_id, "count_job", 1))) and len(seen) >= 3 and max(seen),
                      120)
    old = api.task(DAG_ID, run_id, "count_job")["trigger"]["triggerer_id"]
    deployment.restart_triggerer(crash=False)
    api.wait("count_job's trigger on the new triggerer, logging new ticks",
             lambda: (ti := deferred_on_a_triggerer(api, run_id, "count_job")) and
             ti["trigger"]["triggerer_id"] != old and
             max(ticks(api.log(DAG_ID, run_id, "count_job", 1)), default=0) > before + 3,
             120)
    (jobs_run.release_dir / "count_job").touch()
    task = api.wait_task(DAG_ID, run_id, "count_job", ("success",), timeout=120)
    return RestartedJob(before, task, api.log(DAG_ID, run_id, "count_job", task["try_number"]))


@pytest.fixture(scope="module")
def cleared_hold_job(api: AirflowApi, jobs_run: JobsRun, restarted_count_job: RestartedJob) -> ClearedJob:
    run_id = jobs_run.run_id
    assert api.wait_run(DAG_ID, run_id, timeout=180) == "failed"  # hold_job was marked failed
    (jobs_run.release_dir / "hold_job").touch()
    cleared = api.clear(DAG_ID, run_id, "hold_job")
    state = api.wait_run(DAG_ID, run_id, timeout=300)
    tries = api.tries(DAG_ID, run_id, "hold_job")
    return ClearedJob(cleared, state, tries, api.log(DAG_ID, run_id, "hold_job", tries[-1]["try_number"]))


def test_trigger_conf_chooses_the_slice(jobs_run: JobsRun) -> None:
    tpu = jobs_run.cluster["tpu"]
    assert (tpu["accelerator"], tpu["topology"]) == ("v4", "2x2x1")  # the DAG's defaults are v6e 2x2


def test_sensor_defers_and_a_new_triggerer_resumes_it_after_a_crash(sensor_handover: Handover) -> None:
    assert sensor_handover.deferred["trigger"]["classpath"] == (
        "airflow_provider_raytpu.triggers.raycluster.RayClusterReadyTrigger"
    )
    assert sensor_handover.new_triggerer != sensor_handover.crashed_triggerer
    # Resumed from the deferral, not retried: still the first try.
    assert (sensor_handover.sensor["state"], sensor_handover.sensor["try_number"]) == ("success", 1)


def test_mark_failed_stops_the_running_ray_job(stopped_hold_job: StoppedJob) -> None:
    assert stopped_hold_job.ray_status == "STOPPED"
    assert stopped_hold_job.task_state == "failed"
    # The teardown had not run yet (count_job still waited), so the stop came from on_kill.
    assert stopped_hold_job.count_job_state == "deferred"


def test_deferred_job_completes_across_a_triggerer_restart(restarted_count_job: RestartedJob) -> None:
    assert (restarted_count_job.task["state"], restarted_count_job.task["try_number"]) == ("success", 1)
    seen = ticks(restarted_count_job.log)
    assert seen and max(seen) > restarted_count_job.ticks_before_restart + 3
    assert any("released after" in line for line in restarted_count_job.log)


def test_job_log_has_each_line_once_across_a_triggerer_restart(restarted_count_job: RestartedJob) -> None:
    seen = ticks(restarted_count_job.log)
    assert seen == list(range(1, max(seen) + 1)), "\n".join(
        line for line in restarted_count_job.log if TICK.search(line) or "triggerer" in line or "Continuing" in line)
    released = [line for line in restarted_count_job.log if RELEASED.search(line)]
    assert len(released) == 1, "\n".join(released)


def test_clear_reruns_the_failed_job_with_its_setups(cleared_hold_job: ClearedJob) -> None:
    assert cleared_hold_job.cleared == ["create_cluster", "delete_cluster", "hold_job", "wait_ready"]
    assert cleared_hold_job.run_state == "success"
    assert [(t["try_number"], t["state"]) for t in cleared_hold_job.tries] == [(1, "failed"), (2, "success")]
    assert any("released after 0 ticks" in line for line in cleared_hold_job.log)


def test_a_secret_the_job_prints_after_a_deferral_and_a_triggerer_restart_is_masked_everywhere(
        deployment: AirflowDeployment, api: AirflowApi, jobs_run: JobsRun, restarted_count_job: RestartedJob) -> None:
    """count_job's Ray job prints its secret environment variable before and after the triggerer restart: the
    first triggerer, the restarted one (which knows the secret only from its trigger's arguments, which Airflow
    keeps encrypted) and the resumed task each show it masked, and no file of the deployment holds it."""
    shown = [m.group(1) for line in restarted_count_job.log if (m := SHOWN_TOKEN.search(line))]
    assert shown == ["***", "***"], shown  # printed first and last: by the first triggerer and the restarted one
    assert SECRET not in "\n".join(restarted_count_job.log)
    assert SECRET not in json.dumps(api.xcoms(DAG_ID, jobs_run.run_id, "count_job"))
    holding = {str(path): around(path.read_bytes(), SECRET.encode())
               for folder in (deployment.home, deployment.log_dir) for path in folder.rglob("*")
               if path.is_file() and SECRET.encode() in path.read_bytes()}
    assert holding == {}, "the task logs, every component's log and the database (trigger rows, XComs)"


def around(data: bytes, needle: bytes, chars: int = 300) -> bytes:
    """What surrounds the first ``needle`` in ``data``: where a leaked copy came from."""
    at = data.find(needle)
    return data[max(0, at - chars):at + len(needle) + 40]
