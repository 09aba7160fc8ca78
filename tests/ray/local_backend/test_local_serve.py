"""RayServices on the local backend with real Ray Serve: deploy, zero-downtime promotion, fail fast, stuck deployments.

One emulated cluster for the module (a CPU head and one v6e 2x2 host, 1 CPU each); the
service is the example JAX/Flax model (``example_dags/serving/model.py``), replicas at
0.1 CPU. The tests run in file order on that one service, each starting from the state
the previous one left: v1 deployed, promoted to v2 under load, Serve loses its config and
the cluster's supervisor restores v2, v3 fails at start, then a deployment that no host can
schedule.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
import yaml

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.backends.local.serve import LocalServices, local_cluster_name
from airflow_provider_raytpu.backends.local.state import cluster_dir
from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.hooks.raytpu import default_deployment
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import DAG_ID_KEY, DEPLOYMENT_KEY, TASK_ID_KEY
from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.operators.rayservice import DeleteRayServiceOperator
from airflow_provider_raytpu.status import ServicePhase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.airflow_runner import run_dag, task_instances
from tests.support.task_logs import LOADED_SILENCE_LIMIT_SECONDS, captured_output, problems, task_logs, waited_seconds

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).parents[3] / "example_dags"
SERVICE = "tiny"
NAMESPACE = "default"
APPS = [{
    "name": "tiny",
    "import_path": "serving.model:build_app",
    "route_prefix": "/",
    "version_arg": "model_version",
    "deployments": [{"name": "TinyModel", "num_replicas": 1, "max_surge_percent": 100,
                     "ray_actor_options": {"num_cpus": 0.1}}],
}]
SMALL = {"head_resources": {"cpu": "1", "memory": "2Gi"}, "worker_resources": {"cpu": "1", "memory": "2Gi"},
         "env": {"PYTHONPATH": str(EXAMPLES)}}
INPUTS = {"inputs": [[0.1, 0.2, 0.3, 0.4]]}


@pytest.fixture(scope="module")
def serve_backend(raytpu_home: Path) -> Iterator[LocalServices]:
    """The local backend with RayService support, and ``raytpu_default`` pointing at it; deletes the service after."""
    patch = pytest.MonkeyPatch()
    patch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps(
        {"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
    backend = LocalBackend(ConnectionSettings.from_extra("raytpu_default", {
        "backend": "local", "local_home": str(raytpu_home)}))
    yield backend.services
    backend.services.delete_service(SERVICE, NAMESPACE)
    patch.undo()


# One DAG deploys every version: a RayService is its deploy task's own (DAG, task), and another
# DAG's deploy of the same name is refused as a conflict.
SERVING_DAG = "serve_tiny"


def dag(dag_id: str, *, apps: list[dict[str, Any]] | None = APPS, sensor: str = "") -> str:
    lines = [
        "from datetime import datetime",
        "from airflow.sdk import DAG",
        "from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator",
        "from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor",
        f"with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1),",
        "         default_args={'retries': 2, 'retry_delay': 0}, params={'version': 'v1'}):",
    ]
    if apps is not None:
        lines.append(
            f"    deploy = DeployRayServiceOperator(task_id='deploy', service_name={SERVICE!r}, applications={apps!r}, "
            f"accelerator='v6e', topology='2x2', version='{{{{ params.version }}}}', "
            f"cluster_options={SMALL!r})")
    lines.append(
        f"    wait = RayServiceRunningSensor(task_id='wait_running', service_name={SERVICE!r}, "
        "version='{{ params.version }}', timeout=300, poke_interval=1, " + sensor + ")")
    if apps is not None:
        lines.append("    deploy >> wait")
    return "\n".join(lines) + "\n"


def test_deploy_runs_and_the_model_answers(request: pytest.FixtureRequest, airflow_home: Path,
                                           serve_backend: LocalServices) -> None:
    smoke = f"smoke_request={{'path': '/', 'method': 'POST', 'json': {INPUTS!r}}}"
    with captured_output(request.config) as logs:
        outcome = run_dag(airflow_home, dag(SERVING_DAG, sensor=smoke), SERVING_DAG)
    assert {t: o.state for t, o in outcome.items()} == {"deploy": "success", "wait_running": "success"}
    # The deploy waits for the serving cluster's head, saying so at least every 10 s; the task pages link
    # to the Serve application in the Ray dashboard, and the deploy's log says where the endpoint answers.
    assert logs.out, "run without -s: the task logs are read from pytest's capture"
    tasks = task_instances(outcome)
    assert problems(logs.out, logs.err, tasks, limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    assert {log.task_id for log in task_logs(logs.out, tasks)} == {"deploy", "wait_running"}
    dashboard = serve_backend.dashboard(SERVICE, NAMESPACE).url
    links = {"Serve application": f"{dashboard}/#/serve/applications/tiny"}
    assert outcome["deploy"].links == outcome["wait_running"].links == links
    assert requests.get(dashboard + "/", timeout=30).status_code == 200, "every link offered opens a page"
    assert f"Serve endpoint: tiny at {outcome['deploy'].result['serve_url']}/. Send each application" in logs.out
    reference = outcome["deploy"].result
    assert (reference["service_name"], reference["version"], reference["previous_version"]) == (SERVICE, "v1", None)
    assert reference["serve_url"].startswith("http://127.0.0.1:")
    result = outcome["wait_running"].result
    assert (result["phase"], result["active_version"]) == ("RUNNING", "v1")
    assert result["active_cluster"] == local_cluster_name(SERVICE)
    smoke_answer = result["smoke"]["json"]
    assert result["smoke"]["status"] == 200 and smoke_answer["version"] == "v1"
    assert len(smoke_answer["predictions"]) == 1
    answer = requests.post(reference["serve_url"] + "/", json=INPUTS, timeout=30).json()
    assert answer == smoke_answer, "the same version answers the same"
    assert requests.get(reference["serve_url"] + "/health", timeout=30).json() == {"status": "ok", "version": "v1"}


def test_promotion_under_load_fails_no_request_and_switches_to_v2(airflow_home: Path,
                                                                  serve_backend: LocalServices) -> None:
    url = serve_backend.serve_endpoint(SERVICE, NAMESPACE).url
    answers: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answer = requests.post(url + "/", json=INPUTS, timeout=30)
                if answer.status_code == 200:
                    answers.append(answer.json()["version"])
                else:
                    failures.append(f"{answer.status_code}: {answer.text[:200]}")
            except requests.RequestException as exc:
                failures.append(repr(exc))
            time.sleep(0.05)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        outcome = run_dag(airflow_home, dag(SERVING_DAG), SERVING_DAG, conf={"version": "v2"})
        time.sleep(1)
    finally:
        stop.set()
        thread.join(60)
    assert {t: o.state for t, o in outcome.items()} == {"deploy": "success", "wait_running": "success"}
    assert outcome["deploy"].result["previous_version"] == "v1"
    assert outcome["wait_running"].result["active_version"] == "v2"
    assert failures == []
    assert answers[0] == "v1" and answers[-1] == "v2"
    switched = answers.index("v2")
    assert set(answers[switched:]) == {"v2"}, "once v2 answers, v1 never answers again"
    assert len(answers) > 20


def test_serve_that_lost_its_config_gets_it_back_from_the_clusters_supervisor(serve_backend: LocalServices) -> None:
    """Serve forgets its applications (as a restarted head does): the cluster's supervisor, the local stand-in
    for KubeRay's RayService controller, PUTs the service's config again. Nothing here reads the status."""
    cluster = local_cluster_name(SERVICE)
    dashboard = serve_backend.clusters.dashboard(cluster, NAMESPACE)
    assert dashboard.request("DELETE", "/api/serve/applications/", timeout=120).ok
    supervisor_log = cluster_dir(serve_backend.home, cluster, NAMESPACE) / "supervisor.log"
    url = serve_backend.serve_endpoint(SERVICE, NAMESPACE).url
    deadline = time.monotonic() + 180
    while True:
        resubmitted = "has no applications (head restarted?); submitting again" in supervisor_log.read_text()
        try:
            answer = requests.post(url + "/", json=INPUTS, timeout=10)
            version = answer.json()["version"] if answer.status_code == 200 else answer.status_code
        except requests.RequestException as exc:
            version = repr(exc)
        if (resubmitted and version == "v2") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert resubmitted, supervisor_log.read_text()[-3000:]
    assert version == "v2"


def test_an_application_that_raises_at_start_fails_the_sensor_fast(airflow_home: Path, serve_backend: LocalServices,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    broken = [{**APPS[0], "args": {"fail_at_start": "no weights found at gs://models/tiny/v3"}}]
    started = time.monotonic()
    outcome = run_dag(airflow_home, dag(SERVING_DAG, apps=broken), SERVING_DAG, conf={"version": "v3"})
    assert outcome["deploy"].state == "success"
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    assert time.monotonic() - started < 240
    log = capfd.readouterr().out
    assert "RayService default/tiny FAILED: application 'tiny' is DEPLOY_FAILED on RayCluster tiny-local" in log
    assert "RuntimeError: no weights found at gs://models/tiny/v3" in log
    # The previous version keeps answering while the new one cannot start.
    answer = requests.post(serve_backend.serve_endpoint(SERVICE, NAMESPACE).url + "/", json=INPUTS, timeout=30)
    assert answer.status_code == 200 and answer.json()["version"] == "v2"


def apply_by_hand(backend: LocalServices, version: str, tpu_chips: int) -> None:
    """Apply a RayService written by hand, past the preflight: a replica asks for ``tpu_chips`` TPU chips."""
    manifest = build_ray_service(name=SERVICE, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"), applications=APPS,
                                 version=version, current=backend.get_service(SERVICE, NAMESPACE),
                                 options=RayClusterOptions(**SMALL))
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    config["applications"][0]["deployments"][0]["ray_actor_options"]["resources"] = {"TPU": tpu_chips}
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    # Written as the serving DAG's deploy task would: a RayService belongs to its (deployment, DAG, task).
    manifest["metadata"].setdefault("annotations", {}).update(
        {DEPLOYMENT_KEY: default_deployment(), DAG_ID_KEY: SERVING_DAG, TASK_ID_KEY: "deploy"})
    backend.apply_service(manifest)


def test_a_chip_count_ray_rejects_fails_fast_with_rays_message(
    airflow_home: Path, serve_backend: LocalServices, capfd: pytest.CaptureFixture[str],
) -> None:
    apply_by_hand(serve_backend, "v4", 64)
    outcome = run_dag(airflow_home, dag("serve_64", apps=None, sensor="deploying_timeout=60"), "serve_64",
                      conf={"version": "v4"})
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert "RayService default/tiny FAILED: application 'tiny' is DEPLOY_FAILED" in log
    assert "The number of requested 'TPU' was set to 64 which is not a supported chip configuration" in log


def test_a_stuck_deployment_fails_at_deploying_timeout_with_a_diagnosis(
    airflow_home: Path, serve_backend: LocalServices, capfd: pytest.CaptureFixture[str],
) -> None:
    # 8 chips is a chip count Ray accepts, but every host here has 4: the replica waits forever.
    apply_by_hand(serve_backend, "v5", 8)
    outcome = run_dag(airflow_home, dag("serve_stuck", apps=None, sensor="deploying_timeout=15"), "serve_stuck",
                      conf={"version": "v5"})
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert waited_seconds(log, "application 'tiny' DEPLOYING for {s} s, longer than deploying_timeout=15 s") >= 15
    assert "- application 'tiny' DEPLOYING on active RayCluster tiny-local" in log
    # The previous version's replica keeps running (max_surge_percent) while the new one waits for 8 chips.
    assert ("  - deployment 'TinyModel': 1 replica(s) waiting to start (1 STARTING), 1 RUNNING, 1 wanted; "
            'each replica needs {"CPU": 0.1, "TPU": 8}') in log
    assert "RayCluster tiny-local (active):\n  READY: head ready; 1 of 1 TPU hosts ready" in log
    assert ("applications['tiny'].deployments['TinyModel'].ray_actor_options={'num_cpus': 0.1, 'resources': "
            "{'TPU': 8}}: asks for 8 TPU chips per replica, but one host of a v6e 2x2 slice has 4 chips") in log


def test_delete_removes_the_service_and_its_cluster(serve_backend: LocalServices) -> None:
    status = serve_backend.service_status(SERVICE, NAMESPACE)
    assert status.phase is ServicePhase.DEPLOYING
    context: Any = {"ti": SimpleNamespace(dag_id="d", run_id="r", task_id="delete", map_index=-1)}
    # The service was applied by the test, not by a task of DAG 'd': only force deletes it.
    assert DeleteRayServiceOperator(task_id="delete", service_name=SERVICE).execute(context)["skipped"] == [SERVICE]
    delete = DeleteRayServiceOperator(task_id="delete", service_name=SERVICE, wait_for_deletion=True, force=True)
    assert delete.execute(context)["deleted"] is True
    assert serve_backend.get_service(SERVICE, NAMESPACE) is None
    assert serve_backend.clusters.get_cluster(local_cluster_name(SERVICE), NAMESPACE) is None
    assert serve_backend.service_status(SERVICE, NAMESPACE).phase is ServicePhase.GONE
    assert delete.execute(context)["deleted"] is False
