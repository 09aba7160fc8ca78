"""The RayService Running sensor and its trigger against a Kubernetes API over HTTP, with KubeRay's RayService
controller played step by step (tests/support/rayservice_controller.py): first deploys, promotions, failures,
transient and persistent trouble, reschedule mode."""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.loop_shared import close_loop_shared
from airflow_provider_raytpu.manifests.rayservice import build_ray_service, cluster_version
from airflow_provider_raytpu.status import ServicePhase
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.rayservice import RayServiceRunningTrigger
from tests.fakeapi.serving_dags import LLM_APP, SERVICES, dag, deploy_v1_running
from tests.support.airflow_runner import run_dag
from tests.support.fake_apiserver.kuberay import KubeRayReactor, replica_failure
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE
from tests.support.rayservice_controller import RayServiceController, in_background
from tests.support.serve_stub import ServeStub
from tests.support.task_logs import waited_seconds

pytestmark = pytest.mark.timeout(120)


# -- the Running sensor ----------------------------------------------------------------------------


def test_first_deploy_runs_and_answers_the_smoke_request(airflow_home: Path, connections: None,
                                                         kube: FakeKubeApiServer,
                                                         controller: RayServiceController) -> None:
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
    assert waited_seconds(log, "application 'chat' DEPLOYING for {s} s, longer than deploying_timeout=2 s") >= 2
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
    events = trigger.run()
    event = await anext(events)
    # Closed now, not whenever the generator is collected: the trigger leaves its informer, whose watch
    # stops; a request of it still on the wire lands before the log is cleared.
    await events.aclose()
    await close_loop_shared()
    await asyncio.sleep(0.5)
    assert event.payload["status"] == ServicePhase.GONE.value
    kube.clear_log()
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
    unhealthy = "RayService ml/chat UNHEALTHY for {s} s, longer than grace_period=1 s: application 'chat' is UNHEALTHY"
    assert waited_seconds(log, unhealthy) >= 1


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
