"""Ray job tasks on a real local cluster (one emulated v4 2x2x2 slice): results, logs, failures, retries.

Retry safety is tested the hard way: the Airflow worker is a separate process that is
killed with SIGKILL mid-job, the scheduler's answer (fail the try, retry it) is
played, and the retry must reattach instead of starting a second Ray job.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.job_submission import JobSubmissionClient

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.status import Phase
from tests.ray.local_backend.emulated import CLUSTER_READY_TIMEOUT, EmulatedCluster, watch_until
from tests.ray.local_backend.jobs import (
    PROXIED,
    behind_the_api_server_proxy,
    kill_worker,
    proxied_dag,
    start_worker,
    submit_dag,
    task_jobs,
    wait_for_job,
)
from tests.support.airflow_runner import (
    clear_task,
    ensure_airflow_db,
    lose_worker,
    resume_dag_run,
    run_dag,
    task_instances,
    write_dag,
)
from tests.support.task_logs import LOADED_SILENCE_LIMIT_SECONDS, captured_output, problems, task_logs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cluster(local_backend: LocalBackend, emulated_cluster: EmulatedCluster,
            raytpu_home: Path) -> Iterator[EmulatedCluster]:
    """The module's emulated slice, READY, reachable through the ``raytpu_default`` connection."""
    import asyncio

    asyncio.run(watch_until(local_backend, emulated_cluster.name, emulated_cluster.namespace,
                            lambda s: s.phase is Phase.READY, CLUSTER_READY_TIMEOUT))
    patch = pytest.MonkeyPatch()
    patch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT",
                 json.dumps({"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
    yield emulated_cluster
    patch.undo()


@pytest.fixture(scope="module")
def jobs(local_backend: LocalBackend, cluster: EmulatedCluster) -> JobSubmissionClient:
    return JobSubmissionClient(local_backend.dashboard(cluster.name, cluster.namespace).url)


def test_result_and_streamed_log(airflow_home: Path, cluster: EmulatedCluster, jobs: JobSubmissionClient,
                                 capfd: pytest.CaptureFixture[str]) -> None:
    code = (
        "import os, time\n"
        "from airflow_provider_raytpu.workloads.result import report_result\n"
        "for i in range(3):\n"
        "    print('step', i, flush=True); time.sleep(0.5)\n"
        "report_result({'greeting': os.environ['GREETING'], 'steps': 3,\n"
        "               'airflow_env': sorted(k for k in os.environ if k.startswith('AIRFLOW'))})\n"
    )
    outcome = run_dag(airflow_home, submit_dag("job_result", code), "job_result")["job"]
    # The job has its runtime_env's variables, and none of the Airflow worker's (its connections, its
    # configuration): the local cluster's dashboard has no authentication.
    assert (outcome.state, outcome.result) == ("success", {"greeting": "hello from airflow", "steps": 3,
                                                           "airflow_env": []})
    log = capfd.readouterr().out
    for i in range(3):
        assert log.count(f"[ray job] step {i}") == 1, "each job log line reaches the task log exactly once"
    (job,) = task_jobs(jobs, "job_result")
    assert job.metadata["raytpu.task_id"] == "job" and job.submission_id.endswith("-try1")


async def test_each_line_once_across_a_triggerer_restart(cluster: EmulatedCluster, jobs: JobSubmissionClient,
                                                         capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Ray's real log tail: a trigger stopped mid-job and one started with the position the first saved
    write every line once between them (the restored position is what the task's XCom keeps)."""
    import asyncio
    import re
    import shlex
    import uuid

    from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger

    go_on = tmp_path / "go-on"  # the job holds after its 20th line until the first trigger is stopped
    code = (f"import os, time\nfor i in range(40):\n    print('tick', i, flush=True)\n    if i == 19:\n"
            f"        while not os.path.exists({str(go_on)!r}):\n            time.sleep(0.05)\n")
    submission_id = jobs.submit_job(entrypoint=f"python -c {shlex.quote(code)}",
                                    submission_id=f"restart-{uuid.uuid4().hex[:8]}")

    async def first_event(trigger: RayJobTrigger) -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    first = RayJobTrigger(submission_id, cluster.name, cluster.namespace, "raytpu_default", poll_interval=0.5)
    task = asyncio.create_task(first_event(first))
    while first.logged_chars < len("tick 5\n") * 5:
        await asyncio.sleep(0.05)
    assert not task.done(), "the job should still be running"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go_on.touch()
    second = RayJobTrigger(submission_id, cluster.name, cluster.namespace, "raytpu_default", poll_interval=0.5,
                           logged_chars=first.logged_chars)
    event = await first_event(second)
    assert event["status"] == "SUCCEEDED"
    written = re.findall(r"\[ray job\] (.*?) *\[airflow_provider_raytpu", capfd.readouterr().out)
    # Every line of the job's log once, in order (Ray starts it with its own lines about the entrypoint).
    assert written == [line.rstrip() for line in jobs.get_job_logs(submission_id).splitlines()]
    assert [line for line in written if line.startswith("tick ")] == [f"tick {i}" for i in range(40)]


def test_failing_job_fails_the_task_with_its_log_tail(airflow_home: Path, cluster: EmulatedCluster,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """Within 50 lines, the tail holds Ray's first line, which repeats the command: its --config shows keys only."""
    code = ("import sys\nprint('loading shard 7 of 8')\nprint('ValueError: shard 7 is corrupt', flush=True)\n"
            "sys.exit(3)\n")
    secret = "sk-live-5e4d3c2b1a"
    config = ("--config", json.dumps({"wandb_api_key": secret, "shards": 8}))
    outcome = run_dag(airflow_home, submit_dag("job_fails", code, deferrable=False, args=config), "job_fails")["job"]
    assert outcome.state == "failed"
    log = capfd.readouterr().out
    assert "Ray job raytpu-" in log and "FAILED" in log
    assert "--- last 50 log lines ---" in log and "ValueError: shard 7 is corrupt" in log
    assert "--config '<JSON with keys: wandb_api_key, shards>'" in log
    assert secret not in log


def test_worker_killed_mid_job_retry_reattaches(airflow_home: Path, cluster: EmulatedCluster,
                                                 jobs: JobSubmissionClient) -> None:
    code = "import time\nfrom airflow_provider_raytpu.workloads.result import report_result\n" \
           "time.sleep(12)\nreport_result({'done': True})\n"
    ensure_airflow_db()
    path = write_dag(airflow_home, submit_dag("job_reattach", code, retries=2, deferrable=False), "job_reattach")
    worker = start_worker(path, "job_reattach")
    wait_for_job(jobs, "job_reattach", 1, "RUNNING")
    kill_worker(worker)
    run_id = lose_worker("job_reattach", "job")
    # Meanwhile the DAG's author lowers retries: try 2 is still a retry (its task instance says so), not a Clear.
    write_dag(airflow_home, submit_dag("job_reattach", code, retries=1, deferrable=False), "job_reattach")
    outcome = resume_dag_run(path, "job_reattach", run_id)["job"]
    assert (outcome.state, outcome.try_number, outcome.result) == ("success", 2, {"done": True})
    (only,) = task_jobs(jobs, "job_reattach")
    assert only.submission_id.endswith("-try1") and str(only.status) == "SUCCEEDED"
    assert outcome.links["Ray job"].endswith(f"/#/jobs/{only.submission_id}"), "try 2 links to the job it followed"


def test_failed_job_is_resubmitted_and_the_third_try_finds_the_second(
        airflow_home: Path, cluster: EmulatedCluster, jobs: JobSubmissionClient) -> None:
    # Try 1's job fails; try 2 submits again and its worker dies mid-job; try 3 reattaches to try 2's job.
    code = "import sys, time\nfrom airflow_provider_raytpu.workloads.result import report_result\n" \
           "if {{ ti.try_number }} == 1: sys.exit('first attempt fails')\n" \
           "time.sleep(12)\nreport_result({'attempt': {{ ti.try_number }}})\n"
    ensure_airflow_db()
    path = write_dag(airflow_home, submit_dag("job_third_try", code, retries=2, deferrable=False), "job_third_try")
    worker = start_worker(path, "job_third_try")
    wait_for_job(jobs, "job_third_try", 2, "RUNNING")
    kill_worker(worker)
    run_id = lose_worker("job_third_try", "job")
    outcome = resume_dag_run(path, "job_third_try", run_id)["job"]
    assert (outcome.state, outcome.try_number, outcome.result) == ("success", 3, {"attempt": 2})
    found = task_jobs(jobs, "job_third_try")
    assert [(j.submission_id[-4:], str(j.status)) for j in found] == [("try1", "FAILED"), ("try2", "SUCCEEDED")]


def test_jobs_through_the_api_server_service_proxy(airflow_home: Path, cluster: EmulatedCluster,
                                                  local_backend: LocalBackend, monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """Backend kubernetes: every Jobs API call (package upload, submit, status, logs) goes through the
    API server's service proxy with the Kubernetes client's own TLS and token, and no credential leaks."""
    with behind_the_api_server_proxy(local_backend, cluster, monkeypatch) as kube:
        code = "from airflow_provider_raytpu.workloads.result import report_result\n" \
               "print('via the proxy', flush=True)\nreport_result({'proxied': True})\n"
        outcome = run_dag(airflow_home, proxied_dag("job_proxied", code), "job_proxied")["job"]
        package_calls = kube.count(None, PROXIED + "packages/")
        submits = kube.count("POST", PROXIED + r"jobs/$")
        status_lists = kube.count("GET", PROXIED + r"jobs/$")
        downloads = kube.count("GET", PROXIED + r"jobs/raytpu-[^/]+/logs$")
        streams = kube.proxy.websockets
    assert (outcome.state, outcome.result) == ("success", {"proxied": True})
    # The package is content-addressed: an earlier test may have uploaded it, so Ray only checks for it.
    assert package_calls >= 1 and submits == 1 and status_lists >= 2
    assert (streams, downloads) == (1, 0), "Ray's log tail streams through the proxy; the log is never downloaded"
    log = capfd.readouterr().out
    assert "[ray job] via the proxy" in log
    assert kube.token not in log and kube.token not in json.dumps(outcome.result)


def test_a_job_is_followed_through_an_unreachable_dashboard(
        airflow_home: Path, cluster: EmulatedCluster, local_backend: LocalBackend, jobs: JobSubmissionClient,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The API server's proxy to the dashboard answers 503 for 12 s from the task's first call (its synchronous
    calls), and for 20 s more while the trigger follows the running job: the task succeeds, each line once.

    Both outages are far inside the default grace (10 min); how long they last is only waiting, so they are
    short: what is under test is that calls ride through them and the log says so while they last."""
    import threading

    sync_outage, trigger_outage = 12, 20
    code = ("import time\nfrom airflow_provider_raytpu.workloads.result import report_result\n"
            "for i in range(20):\n    print(f'tick {i:02d}', flush=True)\n    time.sleep(1)\n"
            "report_result({'ticks': 20})\n")
    with behind_the_api_server_proxy(local_backend, cluster, monkeypatch) as kube:
        seen: dict[str, list] = {}

        def outages() -> None:
            kube.wait_for(lambda: kube.count(None, PROXIED), 120)  # the task's first call, refused
            time.sleep(sync_outage)
            seen["during the first outage"] = task_jobs(jobs, "job_outage")
            kube.clear_faults()
            wait_for_job(jobs, "job_outage", 1, "RUNNING", timeout=60)
            time.sleep(3)  # the trigger follows the job
            kube.inject(None, PROXIED, 503, times=None, message="no endpoints available for service")
            time.sleep(trigger_outage)
            kube.clear_faults()

        kube.inject(None, PROXIED, 503, times=None, message="no endpoints available for service")
        faults = threading.Thread(target=outages, daemon=True)
        faults.start()
        outcome = run_dag(airflow_home, proxied_dag("job_outage", code, retries=0), "job_outage")  # the main thread
        faults.join(60)
    assert seen["during the first outage"] == [], "nothing reached the dashboard during the first outage"
    assert (outcome["job"].state, outcome["job"].try_number, outcome["job"].result) == ("success", 1, {"ticks": 20})
    captured = capfd.readouterr()
    log = captured.out
    assert problems(log, captured.err, task_instances(outcome), limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    assert [line for line in re.findall(r"\[ray job\] (tick \d\d)", log)] == [f"tick {i:02d}" for i in range(20)]
    assert "the dashboard of RayCluster ml/emu unreachable for 0 s (answered 503:" in log
    assert re.search(r"Ray job raytpu-\S+: the dashboard of RayCluster ml/emu unreachable for \d+ s \(", log)
    assert not re.search(r"status not read yet", log), "while unreachable, the log says so"
    sync = [int(s) for s in re.findall(r"The dashboard of RayCluster ml/emu answers again after (\d+) s", log)]
    followed = [int(s) for s in re.findall(r"Ray job raytpu-\S+: the dashboard of RayCluster ml/emu answers again "
                                           r"after (\d+) s", log)]
    assert sync and sync_outage <= sync[0] <= sync_outage + 6, f"the sync outage lasted {sync_outage} s: {sync}"
    assert followed and trigger_outage - 6 <= followed[0] <= trigger_outage + 6, f"the trigger's outage: {followed}"


def test_a_job_that_exits_on_bad_input_fails_without_retries(airflow_home: Path, cluster: EmulatedCluster,
                                                            jobs: JobSubmissionClient,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    code = "import sys\nprint('error: module pipeline.trian_loop not found', file=sys.stderr)\nsys.exit(2)\n"
    outcome = run_dag(airflow_home, submit_dag("job_bad_input", code, retries=2, deferrable=False),
                      "job_bad_input")["job"]
    assert (outcome.state, outcome.try_number) == ("failed", 1), "a retry cannot fix a typo"
    assert len(task_jobs(jobs, "job_bad_input")) == 1
    assert "exited with code 2 (bad input): not retried" in capfd.readouterr().out


def test_a_clear_stops_the_leftover_job_and_waits_for_it_before_submitting(
        airflow_home: Path, cluster: EmulatedCluster, jobs: JobSubmissionClient) -> None:
    """The leftover driver ignores SIGTERM for a while (it writes its last checkpoint); no second driver
    may run next to it."""
    code = ("import signal, sys, time\n"
            "from airflow_provider_raytpu.workloads.result import report_result\n"
            "if {{ ti.try_number }} == 1:\n"
            "    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(1)))\n"
            "    time.sleep(120)\n"
            "report_result({'try': {{ ti.try_number }}})\n")
    ensure_airflow_db()
    path = write_dag(airflow_home, submit_dag("job_clear", code, deferrable=False), "job_clear")
    worker = start_worker(path, "job_clear")
    wait_for_job(jobs, "job_clear", 1, "RUNNING")
    kill_worker(worker)
    lose_worker("job_clear", "job")
    run_id = clear_task("job_clear", "job")
    outcome = resume_dag_run(path, "job_clear", run_id)["job"]
    assert (outcome.state, outcome.result) == ("success", {"try": 2})
    leftover, fresh = task_jobs(jobs, "job_clear")
    assert (str(leftover.status), str(fresh.status)) == ("STOPPED", "SUCCEEDED")
    assert fresh.start_time >= leftover.end_time, "the new driver started only once the old one had ended"


def test_one_connection_lookup_and_one_backend_per_task(airflow_home: Path, cluster: EmulatedCluster,
                                                       local_backend: LocalBackend, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Backend gke: a data task reads the cluster's slice and talks to its dashboard through ONE backend,
    so the GKE API is asked for the cluster's endpoint once."""
    import sys as _sys

    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice
    from tests.support.fake_apiserver.kuberay import KubeRayReactor
    from tests.support.fake_apiserver.server import FakeKubeApiServer
    from tests.support.gke_stub import GoogleStub

    _sys.path.insert(0, str(REPO / "example_dags"))
    from pipeline.data import write_dataset

    raw = write_dataset(str(tmp_path / "raw.jsonl"), 40)
    with FakeKubeApiServer(tls=True) as kube, KubeRayReactor(kube, delay=0.1, stagger=0.01):
        with GoogleStub(f"127.0.0.1:{kube.port}", kube.ca_pem, 3600, kube.accept_token) as google:
            kube.create_object(build_ray_cluster(name="emu", namespace="ml", tpu=TpuSlice("v4", "2x2x2")))
            kube.wait_for(lambda: kube.get_object("services", "ml", "emu-head-svc"), 10)
            kube.register_service_proxy("ml", "emu-head-svc", "dashboard",
                                        local_backend.dashboard(cluster.name, cluster.namespace).url)
            monkeypatch.setenv("AIRFLOW_CONN_GCP_TEST", google.gcp_connection("tpu-project"))
            monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_GKE", json.dumps({"conn_type": "raytpu", "extra": {
                "backend": "gke", "gcp_conn_id": "gcp_test", "project_id": "tpu-project", "location": "us-east5",
                "cluster": "tpu-cluster", "namespace": "ml", "gke_api_endpoint": google.url,
                "confirm_with_ray": False}}))  # the fake API's pods are not the emulated cluster's hosts
            source = f'''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.ray_data import RayDataOperator

with DAG("one_backend", schedule=None, start_date=datetime(2026, 1, 1)):
    RayDataOperator(task_id="prep", cluster_name="emu", raytpu_conn_id="raytpu_gke", input_uri={raw!r},
                    output_uri={str(tmp_path / "out")!r}, transform="pipeline.transforms:normalise",
                    actor_per_tpu_host=True, deferrable=False, poll_interval=0.5,
                    runtime_env={{"py_modules": [{str(REPO / "example_dags" / "pipeline")!r}]}})
'''
            outcome = run_dag(airflow_home, source, "one_backend")["prep"]
    assert outcome.state == "success" and outcome.result["rows_out"] == 40
    assert len(google.cluster_reads) == 1, google.cluster_reads


LIFECYCLE = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator

with DAG("local_lifecycle", schedule=None, start_date=datetime(2026, 1, 1)):
    create = CreateRayClusterOperator(task_id="create", namespace="default", accelerator="v4", topology="2x2x2")
    job = SubmitRayJobOperator(
        task_id="job", cluster=create.output, poll_interval=0.5, cluster_ready_timeout=300,
        entrypoint="python -c 'import ray; from airflow_provider_raytpu.workloads.result import report_result; "
                   "ray.init(); report_result({\\"tpu_chips\\": ray.cluster_resources().get(\\"TPU\\")})'",
    )
    delete = DeleteRayClusterOperator(task_id="delete")
    create >> job >> delete.as_teardown(setups=create)
'''


def test_a_job_waits_for_a_cluster_that_is_not_ready_yet(request: pytest.FixtureRequest, airflow_home: Path,
                                                         cluster: EmulatedCluster,
                                                         local_backend: LocalBackend) -> None:
    """Runs last (it replaces the module's cluster). No ready sensor: a cleared job task whose setup
    re-created the cluster finds it provisioning, and waits for it instead of failing on its dashboard.
    The task logs read cleanly (the job says how the cluster stands while it waits, the delete what it
    waits for while the cluster's processes stop) and the links open."""
    local_backend.delete_cluster(cluster.name, cluster.namespace)
    with captured_output(request.config) as logs:
        outcome = run_dag(airflow_home, LIFECYCLE, "local_lifecycle")
    assert {t: o.state for t, o in outcome.items()} == {"create": "success", "job": "success", "delete": "success"}
    assert outcome["job"].try_number == 1 and outcome["job"].result == {"tpu_chips": 8.0}
    name = outcome["create"].result["cluster_name"]
    dashboard = outcome["create"].result["dashboard_url"]
    assert dashboard.startswith("http://127.0.0.1:")
    assert outcome["create"].links == {"Ray dashboard": f"{dashboard}/"}
    assert outcome["job"].links["Ray job"].startswith(f"{dashboard}/#/jobs/raytpu-")
    assert outcome["delete"].links == {}
    assert logs.out, "run without -s: the task logs are read from pytest's capture"
    tasks = task_instances(outcome)
    assert problems(logs.out, logs.err, tasks, limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    by_task = {log.task_id: log for log in task_logs(logs.out, tasks)}
    assert set(by_task) == {"create", "job", "delete"}
    job = [line.message for line in by_task["job"].provider_lines()]
    assert any(m.startswith(f"RayCluster default/{name} is not ready yet") for m in job), job
    assert any(m.startswith(f"RayCluster default/{name} is ready") for m in job), job
    delete = [line.message for line in by_task["delete"].provider_lines()]
    assert delete[-3] == f"RayCluster default/{name} deleted"
    assert delete[-2].startswith(f"RayCluster default/{name} and its pods are gone after ")
    # The local supervisor records when the cluster was first ready, as KubeRay does: the usage is counted.
    assert re.fullmatch(rf"RayCluster default/{name} used [0-9.e-]+ chip-hours of on-demand \(8 chips for "
                        r"[0-9.]+ (s|min) from ready to gone\)", delete[-1]), delete[-1]
    assert outcome["delete"].result["cluster_names"] == [name]
    assert local_backend.get_cluster(name, "default") is None
