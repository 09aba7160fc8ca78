"""RayService deploy, promotion, rollback and the Running sensor against a Kubernetes API over HTTP.

tests/fakekube has no RayService controller, so :class:`RayServiceController` plays its
part as KubeRay v1.5 does it: it creates the RayCluster from the service's
``rayClusterConfig`` (annotations copied, name ``<service>-<5 chars>``), first as the
pending cluster, and writes realistic statuses through ``KubeRayReactor.set_service_status``;
the reactor then runs that cluster's pods as usual.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.errors import ConflictError, PermissionDeniedError
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin
from airflow_provider_raytpu.manifests.rayservice import (
    MODEL_VERSION_ANNOTATION,
    build_ray_service,
    cluster_version,
    service_version,
    version_history,
)
from airflow_provider_raytpu.operators.rayservice import DeleteRayServiceOperator, RollbackRayServiceOperator
from airflow_provider_raytpu.status import ServicePhase
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.rayservice import RayServiceRunningTrigger
from tests.airflow_runner import run_dag
from tests.fakekube.kuberay import KubeRayReactor, replica_failure
from tests.fakekube.server import FakeKubeApiServer
from tests.kube.conftest import NAMESPACE
from tests.kube.serve_stub import ServeStub

pytestmark = pytest.mark.timeout(120)

SERVICES = r"/apis/ray\.io/v1/namespaces/ml/rayservices"
LLM_APP = {
    "name": "chat",
    "import_path": "ray.serve.llm:build_openai_app",
    "args": {"llm_configs": [{"model_loading_config": {"model_id": "chat-model", "model_source": "gs://b/ckpt-0"}}]},
    "version_arg": "llm_configs.0.model_loading_config.model_source",
}


class RayServiceController:
    """KubeRay's RayService controller, played by the test for one service."""

    def __init__(self, kube: FakeKubeApiServer, kuberay: KubeRayReactor, name: str = "chat") -> None:
        self.kube, self.kuberay, self.name = kube, kuberay, name

    def service(self) -> dict[str, Any] | None:
        return self.kube.get_object("rayservices", NAMESPACE, self.name)

    def wait_for_version(self, version: str, timeout: float = 30) -> dict[str, Any]:
        return self.kube.wait_for(lambda: (s := self.service()) and service_version(s) == version and s, timeout)

    def make_cluster(self, suffix: str) -> str:
        """The RayCluster KubeRay creates: the service's rayClusterConfig, its labels and annotations."""
        service = self.service()
        assert service is not None
        name = f"{self.name}-{suffix}"
        self.kube.create_object({
            "apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {**service["metadata"]["labels"], "ray.io/originated-from-cr-name": self.name,
                                    "ray.io/originated-from-crd": "RayService"},
                         "annotations": dict(service["metadata"]["annotations"])},
            "spec": copy.deepcopy(service["spec"]["rayClusterConfig"]),
        })
        return name

    @staticmethod
    def app(status: str, message: str = "", **deployments: tuple[str, str]) -> dict[str, Any]:
        return {"chat": {"status": status, "message": message, "serveDeploymentStatuses": {
            name: {"status": s, "message": m} for name, (s, m) in deployments.items()}}}

    def initializing(self, cluster: str, status: str = "DEPLOYING", message: str = "", **deployments: Any) -> None:
        self.kuberay.set_service_status(
            self.name, NAMESPACE,
            conditions={"Ready": (False, "Initializing"), "UpgradeInProgress": (False, "Initializing")},
            pending=self.app(status, message, **deployments), pending_cluster=cluster)

    def upgrading(self, cluster: str, status: str = "DEPLOYING", message: str = "") -> None:
        self.kuberay.set_service_status(
            self.name, NAMESPACE, conditions={"Ready": True, "UpgradeInProgress": True},
            pending=self.app(status, message), pending_cluster=cluster)

    def serving(self, cluster: str, status: str = "RUNNING") -> None:
        """Promote ``cluster`` to active (or update the active one's applications)."""
        self.kuberay.set_service_status(
            self.name, NAMESPACE, conditions={"Ready": True, "UpgradeInProgress": False},
            active=self.app(status), active_cluster=cluster, pending={}, pending_cluster="", num_serve_endpoints=1)


@pytest.fixture
def controller(kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> RayServiceController:
    return RayServiceController(kube, kuberay)


@contextlib.contextmanager
def in_background(play: Callable[[], None]) -> Iterator[None]:
    """Run ``play`` (KubeRay's part) in a thread while the DAG runs; its errors fail the test."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            play()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    thread.join(30)
    if errors:
        raise errors[0]


def dag(dag_id: str, deploy: str | None = "", sensor: str | None = None) -> str:
    """A DAG with a deploy task (kwargs ``deploy``) and/or a sensor (kwargs ``sensor``)."""
    lines = [
        "from datetime import datetime",
        "from airflow.sdk import DAG",
        "from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator, RollbackRayServiceOperator",
        "from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor",
        f"APPS = {LLM_APP!r}",
        f"with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1),",
        "         default_args={'retries': 2, 'retry_delay': 0}, params={'version': 'gs://b/ckpt-1'}):",
    ]
    if deploy is not None:
        lines.append("    deploy = DeployRayServiceOperator(task_id='deploy', service_name='chat', applications=[APPS], "
                     "accelerator='v6e', topology='4x4', version='{{ params.version }}', " + deploy + ")")
    if sensor is not None:
        version = "{{ ti.xcom_pull('deploy')['version'] }}" if deploy is not None else "{{ params.version }}"
        lines.append("    wait = RayServiceRunningSensor(task_id='wait_running', service_name='chat', "
                     f"version={version!r}, "
                     "timeout=60, poll_interval=1, " + sensor + ")")
    if deploy is not None and sensor is not None:
        lines.append("    deploy >> wait")
    return "\n".join(lines) + "\n"


def deploy_v1_running(backend: KubeRayBackend, controller: RayServiceController, dag_id: str = "serving",
                      **kwargs: Any) -> str:
    """A service already serving gs://b/ckpt-1 on RayCluster chat-old01, deployed by an earlier run of
    ``dag_id``'s deploy task (a later run of that task may promote it)."""
    backend.services.apply_service(build_ray_service(
        name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP], version="gs://b/ckpt-1",
        origin=AirflowOrigin(dag_id, "scheduled__2026-12-01T00:00:00+00:00", "deploy"), **kwargs))
    cluster = controller.make_cluster("old01")
    controller.serving(cluster)
    return cluster


# -- deploy, promote, rollback -----------------------------------------------------------------


def test_deploy_creates_and_the_same_version_again_is_a_no_op(airflow_home: Path, connections: None,
                                                              kube: FakeKubeApiServer) -> None:
    first = run_dag(airflow_home, dag("deploy_once"), "deploy_once")
    again = run_dag(airflow_home, dag("deploy_once"), "deploy_once")
    assert first["deploy"].state == again["deploy"].state == "success"
    assert kube.count("POST", SERVICES + "$") == 1
    assert kube.count("PUT", SERVICES) == 0
    reference = first["deploy"].result
    assert reference == {
        "service_name": "chat",
        "namespace": NAMESPACE,
        "raytpu_conn_id": "raytpu_default",
        "version": "gs://b/ckpt-1",
        "previous_version": None,
        "tpu": {"accelerator": "v6e", "topology": "4x4", "num_slices": 1, "spot": False, "chips_per_host": None},
        "serve_url": f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services/chat-serve-svc:serve/proxy",
    }
    assert again["deploy"].result == reference
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    post = next(r for r in kube.requests if r.method == "POST")
    assert post.query.get("fieldValidation") == "Strict"
    (llm_config,) = yaml.safe_load(stored["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    assert llm_config["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    assert llm_config["model_loading_config"]["model_source"] == "gs://b/ckpt-1"


def test_promote_writes_the_version_into_the_cluster_config(airflow_home: Path, connections: None,
                                                            kube: FakeKubeApiServer) -> None:
    run_dag(airflow_home, dag("promote"), "promote")
    before = kube.get_object("rayservices", NAMESPACE, "chat")
    outcome = run_dag(airflow_home, dag("promote"), "promote", conf={"version": "gs://b/ckpt-2"})
    assert outcome["deploy"].result["previous_version"] == "gs://b/ckpt-1"
    assert outcome["deploy"].result["version"] == "gs://b/ckpt-2"
    assert (kube.count("POST", SERVICES + "$"), kube.count("PUT", SERVICES + "/chat$")) == (1, 1)
    after = kube.get_object("rayservices", NAMESPACE, "chat")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    notes = after["metadata"]["annotations"]
    assert notes[MODEL_VERSION_ANNOTATION] == "gs://b/ckpt-2"
    assert json.loads(notes["raytpu.dev/version-history"]) == ["gs://b/ckpt-1", "gs://b/ckpt-2"]
    assert notes["raytpu.dev/update"] == "new-cluster"
    config = after["spec"]["rayClusterConfig"]
    assert cluster_version({"spec": config}) == "gs://b/ckpt-2"
    worker = config["workerGroupSpecs"][0]["template"]["metadata"]["annotations"]
    assert worker[MODEL_VERSION_ANNOTATION] == "gs://b/ckpt-2"
    assert cluster_version({"spec": before["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"


def test_rollback_promotes_the_previous_version_and_a_retry_keeps_it(airflow_home: Path, connections: None,
                                                                     kube: FakeKubeApiServer) -> None:
    run_dag(airflow_home, dag("versions"), "versions")
    run_dag(airflow_home, dag("versions"), "versions", conf={"version": "gs://b/ckpt-2"})
    source = dag("rollback", deploy=None).replace(
        "params={'version': 'gs://b/ckpt-1'}):",
        "params={}):\n    RollbackRayServiceOperator(task_id='rollback', service_name='chat')")
    outcome = run_dag(airflow_home, source, "rollback")
    assert outcome["rollback"].state == "success"
    assert (outcome["rollback"].result["version"], outcome["rollback"].result["previous_version"]) == (
        "gs://b/ckpt-1", "gs://b/ckpt-2")
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    assert version_history(stored) == ["gs://b/ckpt-1", "gs://b/ckpt-2", "gs://b/ckpt-1"]
    assert cluster_version({"spec": stored["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"
    source_args = yaml.safe_load(stored["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert source_args["llm_configs"][0]["model_loading_config"]["model_source"] == "gs://b/ckpt-1"
    # The RayService keeps its owner (the deploy task of DAG 'versions'); the rollback is recorded apart.
    notes = stored["metadata"]["annotations"]
    assert (notes["raytpu.dev/dag-id"], notes["raytpu.dev/task-id"]) == ("versions", "deploy")
    dag_id, run_id, task_id, version = json.loads(notes["raytpu.dev/rolled-back-by"])
    assert (dag_id, task_id, version) == ("rollback", "rollback", "gs://b/ckpt-1")
    # A retry of the same task (same run) must not toggle back to ckpt-2.
    links: dict[str, Any] = {}
    ti = SimpleNamespace(dag_id="rollback", run_id=run_id, task_id="rollback",
                         xcom_push=lambda key, value: links.__setitem__(key, value))
    retry = RollbackRayServiceOperator(task_id="rollback", service_name="chat")
    puts = kube.count("PUT", SERVICES + "/chat$")
    assert retry.execute({"ti": ti})["version"] == "gs://b/ckpt-1"
    assert kube.count("PUT", SERVICES + "/chat$") == puts
    # The task page's links: through the API server's service proxy, the transport in use.
    proxy = f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services"
    assert links == {"_link_ServeApplicationLink": f"{proxy}/chat-head-svc:dashboard/proxy/#/serve/applications/chat",
                     "_link_ServeEndpointLink": f"{proxy}/chat-serve-svc:serve/proxy"}


def test_params_choose_the_serving_cluster_options(airflow_home: Path, connections: None,
                                                   kube: FakeKubeApiServer) -> None:
    from airflow_provider_raytpu.manifests.options import RayClusterOptions
    from airflow_provider_raytpu.manifests.raycluster import SPEC_HASH_ANNOTATION

    options = ("image='{{ params.image }}', cluster_options={'worker_resources': {'cpu': '{{ params.worker_cpu }}', "
               "'memory': '64Gi'}, 'labels': {'team': '{{ params.team }}'}}")
    source = dag("serve_options", deploy=options).replace(
        "params={'version': 'gs://b/ckpt-1'}",
        "params={'version': 'gs://b/ckpt-1', 'image': 'rayproject/ray:2.60.0-py311-tpu', 'worker_cpu': '8', "
        "'team': 'ml'}")
    outcome = run_dag(airflow_home, source, "serve_options",
                      conf={"image": "rayproject/ray-llm:2.61.0-py311-tpu", "worker_cpu": "40", "team": "research"})
    assert outcome["deploy"].state == "success"
    stored = kube.get_object("rayservices", NAMESPACE, "chat")
    config = stored["spec"]["rayClusterConfig"]
    (worker,) = config["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert config["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == worker["image"] == (
        "rayproject/ray-llm:2.61.0-py311-tpu")
    assert config["rayVersion"] == "2.61.0"
    assert worker["resources"]["limits"] == {"cpu": "40", "memory": "64Gi", "google.com/tpu": "4"}
    assert stored["metadata"]["labels"]["team"] == "research"
    by_hand = build_ray_service(
        name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP], version="gs://b/ckpt-1",
        options=RayClusterOptions(image="rayproject/ray-llm:2.61.0-py311-tpu", labels={"team": "research"},
                                  worker_resources={"cpu": "40", "memory": "64Gi"}))
    assert stored["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == by_hand["metadata"]["annotations"][SPEC_HASH_ANNOTATION]


def test_bad_input_fails_before_any_api_call(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    source = dag("no_topology").replace(f"APPS = {LLM_APP!r}", "APPS = " + repr({
        **LLM_APP, "args": {"llm_configs": [{"model_loading_config": {"model_id": "m"},
                                             "accelerator_config": {"kind": "tpu"}}]}}))
    outcome = run_dag(airflow_home, source, "no_topology")
    assert (outcome["deploy"].state, outcome["deploy"].try_number) == ("failed", 1)
    assert kube.count("POST") == 0 and kube.count("PUT") == 0


def test_backend_conflicts_and_permissions(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    manifest = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"),
                                 applications=[LLM_APP], version="v1")
    foreign = copy.deepcopy(manifest)
    foreign["metadata"]["labels"] = {}
    kube.create_object(foreign)
    with pytest.raises(ConflictError, match="not made by this provider"):
        backend.services.apply_service(manifest)
    kube.delete_object("rayservices", NAMESPACE, "chat", force=True)
    assert backend.services.apply_service(manifest).action is Applied.CREATED
    # KubeRay wrote the status between our read and our write: the stale PUT is retried.
    kube.inject("PUT", SERVICES + "/chat$", 409)
    promoted = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP],
                                 version="v2", current=backend.services.get_service("chat", NAMESPACE))
    assert backend.services.apply_service(promoted).action is Applied.UPDATED
    assert kube.count("PUT", SERVICES + "/chat$") == 2
    assert backend.services.apply_service(promoted).action is Applied.ADOPTED
    kube.deny("create", "rayservices")
    with pytest.raises(PermissionDeniedError, match="may not create rayservices.ray.io in namespace 'ml'"):
        backend.services.apply_service(build_ray_service(name="other", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"),
                                                applications=[LLM_APP], version="v1"))
    assert backend.services.delete_service("chat", NAMESPACE) is True
    assert backend.services.delete_service("chat", NAMESPACE) is False


def test_delete_operator_succeeds_when_gone(connections: None, kube: FakeKubeApiServer) -> None:
    context: Any = {"ti": SimpleNamespace(dag_id="d", run_id="r", task_id="delete")}
    delete = DeleteRayServiceOperator(task_id="delete", service_name="chat", wait_for_deletion=True, poll_interval=0.1)
    assert delete.execute(context) == {"service_name": "chat", "service_names": ["chat"], "namespace": NAMESPACE,
                                       "deleted": False}


# -- the Running sensor ----------------------------------------------------------------------------


def test_first_deploy_runs_and_answers_the_smoke_request(airflow_home: Path, connections: None,
                                                         kube: FakeKubeApiServer, controller: RayServiceController) -> None:
    smoke = "smoke_request={'path': '/v1/chat/completions', 'method': 'POST', 'json': {'model': 'chat-model', " \
            "'messages': [{'role': 'user', 'content': 'hi'}]}}"

    def play() -> None:
        controller.wait_for_version("gs://b/ckpt-1")
        cluster = controller.make_cluster("new01")
        controller.initializing(cluster)
        kube.wait_for(lambda: kube.count("GET", SERVICES + "$", watch=True) >= 1, 30)
        time.sleep(0.5)
        controller.initializing(cluster, "RUNNING")
        time.sleep(0.5)
        controller.serving(cluster)

    with ServeStub() as stub:
        kube.create_object({"apiVersion": "v1", "kind": "Service",
                            "metadata": {"name": "chat-serve-svc", "namespace": NAMESPACE},
                            "spec": {"ports": [{"name": "serve", "port": 8000, "targetPort": 8000}]}})
        kube.register_service_proxy(NAMESPACE, "chat-serve-svc", "serve", stub.url)
        with in_background(play):
            outcome = run_dag(airflow_home, dag("first", sensor=smoke), "first")
    assert {t: o.state for t, o in outcome.items()} == {"deploy": "success", "wait_running": "success"}
    result = outcome["wait_running"].result
    assert (result["phase"], result["active_cluster"], result["active_version"]) == (
        "RUNNING", "chat-new01", "gs://b/ckpt-1")
    assert result["smoke"] == {"status": 200, "json": {
        "object": "chat.completion", "model": "chat-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "echo: hi"}}]}}
    assert ("POST", "/v1/chat/completions", {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}) \
        in stub.requests
    assert kube.count("GET", SERVICES + "$", watch=True) >= 1, "the sensor should have deferred to the watch"


def test_promotion_succeeds_only_once_the_new_cluster_is_active(
    airflow_home: Path, connections: None, backend: KubeRayBackend, kube: FakeKubeApiServer,
    controller: RayServiceController,
) -> None:
    old = deploy_v1_running(backend, controller, "switch")
    seen: list[str] = []

    def play() -> None:
        controller.wait_for_version("gs://b/ckpt-2")
        seen.append(backend.services.service_status("chat", NAMESPACE, "gs://b/ckpt-2").message)
        # KubeRay observed the new spec but the OLD cluster still serves: Ready, RUNNING, no pending cluster yet.
        controller.serving(old)
        kube.wait_for(lambda: kube.count("GET", SERVICES + "$", watch=True) >= 1, 30)
        time.sleep(1.5)
        seen.append(backend.services.service_status("chat", NAMESPACE, "gs://b/ckpt-2").message)
        new = controller.make_cluster("new02")
        controller.upgrading(new)
        time.sleep(1)
        controller.upgrading(new, "RUNNING")
        time.sleep(0.5)
        controller.serving(new)

    with in_background(play):
        outcome = run_dag(airflow_home, dag("switch", sensor=""), "switch", conf={"version": "gs://b/ckpt-2"})
    assert outcome["wait_running"].state == "success"
    result = outcome["wait_running"].result
    assert result["active_cluster"] == "chat-new02" and result["active_version"] == "gs://b/ckpt-2"
    assert seen == ["KubeRay has not yet reconciled the latest spec",
                    "RayCluster chat-old01 serves version 'gs://b/ckpt-1'; KubeRay has not started a cluster for "
                    "version 'gs://b/ckpt-2' yet"]
    clusters = {c["metadata"]["name"]: cluster_version(c) for c in kube.list_objects("rayclusters", NAMESPACE)}
    assert clusters == {old: "gs://b/ckpt-1", "chat-new02": "gs://b/ckpt-2"}


def test_deploy_failed_fails_fast_with_the_application_message(
    airflow_home: Path, connections: None, kube: FakeKubeApiServer, controller: RayServiceController,
    capfd: pytest.CaptureFixture[str],
) -> None:
    message = "Failed to build application 'chat': RuntimeError: no weights at gs://b/ckpt-1"

    def play() -> None:
        controller.wait_for_version("gs://b/ckpt-1")
        cluster = controller.make_cluster("bad01")
        controller.initializing(cluster)
        time.sleep(0.5)
        controller.initializing(cluster, "DEPLOY_FAILED", message)

    with in_background(play):
        outcome = run_dag(airflow_home, dag("fails", sensor=""), "fails")
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert "RayService ml/chat FAILED: application 'chat' is DEPLOY_FAILED on RayCluster chat-bad01: " + message in log


def test_deploying_too_long_fails_with_a_diagnosis(
    airflow_home: Path, connections: None, backend: KubeRayBackend, kube: FakeKubeApiServer,
    kuberay: KubeRayReactor, controller: RayServiceController, capfd: pytest.CaptureFixture[str],
) -> None:
    # A RayService written by hand (no preflight): an LLM on a 4-host slice without topology.
    manifest = build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"),
                                 applications=[LLM_APP], version="gs://b/ckpt-1")
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    config["applications"][0]["args"]["llm_configs"][0]["accelerator_config"] = {"kind": "tpu"}
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    backend.services.apply_service(manifest)
    kuberay.set_mode(replica_failure(), cluster="chat-slow1", namespace=NAMESPACE)
    cluster = controller.make_cluster("slow1")
    waiting = ("Deployment 'LLMServer:chat-model' in application 'chat' has 1 replicas that have taken more than "
               "30s to be scheduled. Resources required for each replica: [{'TPU': 1.0}] * 16")
    controller.initializing(cluster, **{"LLMServer:chat-model": ("UPDATING", waiting)})
    with ServeStub() as stub:
        stub.applications = {"chat": {"status": "DEPLOYING", "deployments": {"LLMServer:chat-model": {
            "target_num_replicas": 1, "replicas": [], "required_resources": {"CPU": 1}}}}}
        kube.wait_for(lambda: kube.get_object("services", NAMESPACE, f"{cluster}-head-svc"), 10)
        kube.register_service_proxy(NAMESPACE, f"{cluster}-head-svc", "dashboard", stub.url)
        outcome = run_dag(airflow_home, dag("stuck", deploy=None, sensor="deploying_timeout=2"), "stuck")
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert "application 'chat' DEPLOYING for 2 s, longer than deploying_timeout=2 s" in log
    assert "- application 'chat' DEPLOYING on pending RayCluster chat-slow1" in log
    assert f"  - deployment 'LLMServer:chat-model' UPDATING: {waiting}" in log
    assert ("  - deployment 'LLMServer:chat-model': 1 replica(s) waiting to start (1 not created yet), 0 RUNNING, "
            '1 wanted; each replica needs {"CPU": 1}') in log
    assert "RayCluster chat-slow1 (pending):" in log and "exceeded quota: tpu-quota" in log
    assert "accelerator_config={'kind': 'tpu'}: has no topology, but a v6e 4x4 slice has 4 hosts" in log


def test_in_place_promotion_waits_for_serves_own_record(
    airflow_home: Path, connections: None, backend: KubeRayBackend, kube: FakeKubeApiServer,
    controller: RayServiceController,
) -> None:
    cluster = deploy_v1_running(backend, controller, "inplace")

    def record(version: str) -> dict[str, Any]:
        rendered = yaml.safe_load(controller.service()["spec"]["serveConfigV2"])["applications"][0]  # type: ignore[index]
        args = copy.deepcopy(rendered["args"])
        args["llm_configs"][0]["model_loading_config"]["model_source"] = version
        return {"chat": {"status": "RUNNING", "deployed_app_config": {**rendered, "args": args}}}

    with ServeStub() as stub:
        stub.applications = record("gs://b/ckpt-1")
        kube.wait_for(lambda: kube.get_object("services", NAMESPACE, f"{cluster}-head-svc"), 10)
        kube.register_service_proxy(NAMESPACE, f"{cluster}-head-svc", "dashboard", stub.url)

        def play() -> None:
            controller.wait_for_version("gs://b/ckpt-2")
            controller.serving(cluster, "DEPLOYING")
            time.sleep(0.5)
            controller.serving(cluster, "RUNNING")  # KubeRay's status lags: Serve still has ckpt-1
            time.sleep(2)
            stub.applications = record("gs://b/ckpt-2")

        with in_background(play):
            outcome = run_dag(airflow_home, dag("inplace", deploy="in_place=True", sensor=""), "inplace",
                              conf={"version": "gs://b/ckpt-2"})
    assert outcome["wait_running"].state == "success"
    result = outcome["wait_running"].result
    assert result["active_cluster"] == cluster and result["active_version"] == "gs://b/ckpt-2"
    stored = controller.service()
    assert stored["metadata"]["annotations"]["raytpu.dev/update"] == "in-place"  # type: ignore[index]
    assert cluster_version({"spec": stored["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"  # type: ignore[index]
    assert [c["metadata"]["name"] for c in kube.list_objects("rayclusters", NAMESPACE)] == [cluster]
    assert sum(1 for r in stub.requests if r[1] == "/api/serve/applications/") >= 2


def test_trigger_serialization_round_trips() -> None:
    trigger = RayServiceRunningTrigger("chat", NAMESPACE, "raytpu_default", time.time() + 60, "v2", 600.0, 5.0)
    path, kwargs = trigger.serialize()
    assert path == "airflow_provider_raytpu.triggers.rayservice.RayServiceRunningTrigger"
    assert RayServiceRunningTrigger(**kwargs).serialize() == (path, kwargs)


async def test_trigger_fires_gone_and_poke_mode_works(backend: KubeRayBackend, controller: RayServiceController,
                                                      airflow_home: Path, kube: FakeKubeApiServer) -> None:
    trigger = RayServiceRunningTrigger("chat", NAMESPACE, "raytpu_default", time.time() + 30, None, None, 0.5)
    async for event in trigger.run():
        assert event.payload["status"] == ServicePhase.GONE.value
        break
    kube.clear_log()  # the trigger's informer listed and may have started its watch
    deploy_v1_running(backend, controller)
    outcome = run_dag(airflow_home, dag("poke", deploy=None, sensor="deferrable=False"), "poke")
    assert outcome["wait_running"].state == "success"
    assert kube.count("GET", SERVICES + "$", watch=True) == 0


# -- transient and persistent trouble; reschedule mode ---------------------------------------------


def test_an_unhealthy_application_that_recovers_is_waited_out(
    airflow_home: Path, connections: None, backend: KubeRayBackend, kube: FakeKubeApiServer,
    controller: RayServiceController,
) -> None:
    """Serve may recover an UNHEALTHY application (a replica's health check failed and it restarts)."""
    cluster = deploy_v1_running(backend, controller, "recovers")

    def play() -> None:
        kube.wait_for(lambda: kube.count("GET", SERVICES + "$", watch=True) >= 1, 30)
        controller.serving(cluster, "UNHEALTHY")
        time.sleep(1.5)  # the trigger sees it UNHEALTHY meanwhile
        controller.serving(cluster, "RUNNING")

    controller.serving(cluster, "DEPLOYING")
    with in_background(play):
        outcome = run_dag(airflow_home, dag("recovers", deploy=None, sensor=""), "recovers")
    assert outcome["wait_running"].state == "success"


def test_an_application_unhealthy_past_the_grace_period_fails(
    airflow_home: Path, connections: None, backend: KubeRayBackend, controller: RayServiceController,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cluster = deploy_v1_running(backend, controller, "stays_unhealthy")
    controller.serving(cluster, "UNHEALTHY")
    outcome = run_dag(airflow_home, dag("stays_unhealthy", deploy=None, sensor="grace_period=1"), "stays_unhealthy")
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert "RayService ml/chat UNHEALTHY for 1 s, longer than grace_period=1 s: application 'chat' is UNHEALTHY" in log


def test_reschedule_mode_keeps_the_deploying_clock_across_pokes(
    airflow_home: Path, connections: None, backend: KubeRayBackend, kube: FakeKubeApiServer,
    controller: RayServiceController, capfd: pytest.CaptureFixture[str],
) -> None:
    """Each poke is a new process: the DEPLOYING time is Serve's own record of when it deployed the application."""
    cluster = deploy_v1_running(backend, controller, "rescheduled")
    controller.serving(cluster, "DEPLOYING")
    with ServeStub() as stub:
        stub.applications = {"chat": {"status": "DEPLOYING"}}
        kube.wait_for(lambda: kube.get_object("services", NAMESPACE, f"{cluster}-head-svc"), 10)
        kube.register_service_proxy(NAMESPACE, f"{cluster}-head-svc", "dashboard", stub.url)

        def deployed_as_the_sensor_first_looks() -> None:
            kube.wait_for(lambda: any(path == "/api/serve/applications/" for _, path, _ in stub.requests), 30)
            stub.applications = {"chat": {"status": "DEPLOYING", "last_deployed_time_s": time.time()}}

        sensor = "deferrable=False, mode='reschedule', deploying_timeout=3"
        with in_background(deployed_as_the_sensor_first_looks):
            outcome = run_dag(airflow_home, dag("rescheduled", deploy=None, sensor=sensor), "rescheduled",
                              fresh_operators=True)
    assert (outcome["wait_running"].state, outcome["wait_running"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert "Rescheduling task, marking task as UP_FOR_RESCHEDULE" in log, "it took more than one poke"
    assert "application 'chat' DEPLOYING for " in log and "longer than deploying_timeout=3 s" in log
