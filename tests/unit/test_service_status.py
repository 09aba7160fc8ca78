"""Reading RayService status: RUNNING only when the ACTIVE cluster serves the requested version."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.status import (
    ServicePhase,
    ServiceStatus,
    describe_replicas,
    diagnose_ray_service,
    read_ray_service,
)
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.rayservice import ApplicationClock

APPS = [{"name": "model", "import_path": "serving.model:build_app", "version_arg": "model_version"}]


def spec(version: str = "v1", current: dict | None = None, **kwargs: Any) -> dict[str, Any]:
    manifest = build_ray_service(name="svc", namespace="ml", tpu=TpuSlice("v6e", "4x4"),
                                 **{"applications": APPS, **kwargs}, version=version, current=current)
    manifest["metadata"]["generation"] = 1 + (current or {}).get("metadata", {}).get("generation", 0)
    return manifest


def made_by_kuberay(service: dict[str, Any], name: str) -> dict[str, Any]:
    """The RayCluster KubeRay makes from a RayService: its rayClusterConfig and a copy of its annotations."""
    return {"metadata": {"name": name, "annotations": dict(service["metadata"]["annotations"])},
            "spec": copy.deepcopy(service["spec"]["rayClusterConfig"])}


def condition(kind: str, status: bool | str, reason: str = "", message: str = "") -> dict[str, str]:
    text = status if isinstance(status, str) else ("True" if status else "False")
    return {"type": kind, "status": text, "reason": reason or kind, "message": message}


def apps(status: str = "RUNNING", message: str = "", **deployments: tuple[str, str]) -> dict[str, Any]:
    return {"model": {"status": status, "message": message, "serveDeploymentStatuses": {
        name: {"status": s, "message": m} for name, (s, m) in deployments.items()}}}


def with_status(service: dict[str, Any], *, ready: bool = True, upgrading: bool = False, active: str = "",
                pending: str = "", active_apps: dict | None = None, pending_apps: dict | None = None,
                observed: int | None = None, ready_reason: str = "", ready_message: str = "") -> dict[str, Any]:
    service = copy.deepcopy(service)
    service["status"] = {
        "observedGeneration": service["metadata"]["generation"] if observed is None else observed,
        "conditions": [condition("Ready", ready, ready_reason, ready_message),
                       condition("UpgradeInProgress", upgrading)],
        "activeServiceStatus": {"rayClusterName": active, "applicationStatuses": active_apps or {}} if active else {},
        "pendingServiceStatus": ({"rayClusterName": pending, "applicationStatuses": pending_apps or {}}
                                 if pending else {}),
    }
    return service


V1 = spec("v1")
V2 = spec("v2", current=V1)
OLD, NEW = made_by_kuberay(V1, "svc-old12"), made_by_kuberay(V2, "svc-new34")


def test_missing_and_deleted() -> None:
    assert read_ray_service(None).phase is ServicePhase.GONE
    deleting = copy.deepcopy(V1)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert read_ray_service(deleting).phase is ServicePhase.GONE


def test_not_reconciled_yet() -> None:
    status = read_ray_service(V1)
    assert status.phase is ServicePhase.DEPLOYING and "not yet reconciled" in status.message
    stale = with_status(V2, active="svc-old12", active_apps=apps(), observed=1)
    assert read_ray_service(stale, active_cluster=OLD).phase is ServicePhase.DEPLOYING


def test_first_cluster_is_pending_until_it_serves() -> None:
    service = with_status(V1, ready=False, pending="svc-old12", pending_apps=apps("DEPLOYING"))
    status = read_ray_service(service, pending_cluster=OLD)
    assert status.phase is ServicePhase.DEPLOYING
    assert "preparing first RayCluster svc-old12 for version 'v1': model DEPLOYING" in status.message
    assert status.pending_version == "v1" and status.active_version is None


def test_running() -> None:
    status = read_ray_service(with_status(V1, active="svc-old12", active_apps=apps()), active_cluster=OLD)
    assert status.phase is ServicePhase.RUNNING
    assert status.active_version == "v1" and status.ready and not status.upgrading
    assert status.message == "version 'v1' serving on RayCluster svc-old12: model RUNNING"


def test_the_old_active_cluster_never_counts_for_a_new_version() -> None:
    # Right after the promotion the status still shows the old cluster RUNNING and Ready.
    service = with_status(V2, active="svc-old12", active_apps=apps())
    status = read_ray_service(service, active_cluster=OLD)
    assert status.phase is ServicePhase.UPGRADING
    assert status.active_version == "v1"
    assert "serves version 'v1'; KubeRay has not started a cluster for version 'v2'" in status.message


def test_upgrade_in_progress_then_switch() -> None:
    during = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps(),
                         pending="svc-new34", pending_apps=apps("DEPLOYING"))
    status = read_ray_service(during, active_cluster=OLD, pending_cluster=NEW)
    assert status.phase is ServicePhase.UPGRADING
    assert (status.active_version, status.pending_version) == ("v1", "v2")
    assert status.target_cluster == "svc-new34"
    assert "RayCluster svc-old12 keeps serving" in status.message
    # Pending RUNNING but not yet switched: still upgrading.
    ready_pending = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps(),
                                pending="svc-new34", pending_apps=apps())
    assert read_ray_service(ready_pending, active_cluster=OLD, pending_cluster=NEW).phase is ServicePhase.UPGRADING
    after = with_status(V2, active="svc-new34", active_apps=apps())
    status = read_ray_service(after, active_cluster=NEW)
    assert status.phase is ServicePhase.RUNNING and status.active_version == "v2"


def test_deploy_failed_on_the_new_cluster_fails_with_the_message() -> None:
    service = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps(),
                          pending="svc-new34", pending_apps=apps(
                              "DEPLOY_FAILED", "Failed to build application: RuntimeError: weights not found",
                              TinyModel=("DEPLOY_FAILED", "replica constructor raised")))
    status = read_ray_service(service, active_cluster=OLD, pending_cluster=NEW)
    assert status.phase is ServicePhase.FAILED and status.failed_application == "model"
    assert status.message == ("application 'model' is DEPLOY_FAILED on RayCluster svc-new34: Failed to build "
                              "application: RuntimeError: weights not found; deployment 'TinyModel' DEPLOY_FAILED: "
                              "replica constructor raised")


def test_unhealthy_on_the_serving_cluster_is_not_final() -> None:
    service = with_status(V1, active="svc-old12", active_apps=apps("UNHEALTHY", "replica health check failed"))
    status = read_ray_service(service, active_cluster=OLD)
    assert status.phase is ServicePhase.UNHEALTHY and "replica health check failed" in status.message
    assert not status.finished, "Serve may recover it: the waiter's grace period decides"


def test_an_unhealthy_clock_fires_only_after_the_grace_period() -> None:
    clock = ApplicationClock(limit=600, state="UNHEALTHY")
    unhealthy = read_ray_service(with_status(V1, active="svc-old12", active_apps=apps("UNHEALTHY")),
                                 active_cluster=OLD)
    clock.update(unhealthy, now=0)
    assert clock.overdue(599) is None and clock.seconds_left(599) == 1
    recovered = read_ray_service(with_status(V1, active="svc-old12", active_apps=apps()), active_cluster=OLD)
    clock.update(recovered, now=500)
    clock.update(unhealthy, now=550)
    assert clock.overdue(1100) is None and clock.overdue(1150) == ("model", 600)


def test_a_failure_message_with_braces_is_quoted_as_it_is() -> None:
    # Serve's DEPLOY_FAILED message carries the user's traceback, source lines and dict literals included.
    message = 'Traceback: return {"weights": path} -> KeyError: {0}'
    service = with_status(V1, active="svc-old12", active_apps=apps("DEPLOY_FAILED", message))
    status = read_ray_service(service, active_cluster=OLD)
    assert status.phase is ServicePhase.FAILED
    assert status.message == f"application 'model' is DEPLOY_FAILED on RayCluster svc-old12: {message}"


def test_the_old_clusters_trouble_does_not_fail_the_new_version() -> None:
    service = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps("UNHEALTHY"),
                          pending="svc-new34", pending_apps=apps("DEPLOYING"))
    assert read_ray_service(service, active_cluster=OLD, pending_cluster=NEW).phase is ServicePhase.UPGRADING
    stale = with_status(V2, active="svc-old12", active_apps=apps("DEPLOY_FAILED"))
    assert read_ray_service(stale, active_cluster=OLD).phase is ServicePhase.UPGRADING


@pytest.mark.parametrize("app_status", ["NOT_STARTED", "DEPLOYING", "DELETING"])
def test_applications_not_running(app_status: str) -> None:
    status = read_ray_service(with_status(V1, active="svc-old12", active_apps=apps(app_status)), active_cluster=OLD)
    assert status.phase is ServicePhase.DEPLOYING and f"model {app_status}" in status.message
    assert status.active_version is None


def test_ready_and_upgrade_conditions() -> None:
    no_endpoints = with_status(V1, ready=False, ready_reason="ZeroServeEndpoints", active="svc-old12",
                               active_apps=apps())
    status = read_ray_service(no_endpoints, active_cluster=OLD)
    assert status.phase is ServicePhase.DEPLOYING and "ZeroServeEndpoints" in status.message
    upgrading = with_status(V1, upgrading=True, active="svc-old12", active_apps=apps())
    assert read_ray_service(upgrading, active_cluster=OLD).phase is ServicePhase.UPGRADING
    timeout = with_status(V1, ready=False, ready_reason="InitializingTimeout", ready_message="initializing > 10m",
                          pending="svc-old12", pending_apps=apps("DEPLOYING"))
    status = read_ray_service(timeout, pending_cluster=OLD)
    assert status.phase is ServicePhase.FAILED and "initializing > 10m" in status.message


def test_unreadable_or_missing_parts() -> None:
    service = with_status(V1, active="svc-old12", active_apps=apps())
    assert "cannot be read" in read_ray_service(service).message
    empty = with_status(V1, active="svc-old12", active_apps={})
    assert "no applications reported yet" in read_ray_service(empty, active_cluster=OLD).message
    two = spec("v1", applications=[*APPS, {"name": "other", "import_path": "serving.model:build_app",
                                            "args": {"model_version": "x"}}])
    partial = with_status(two, active="svc-old12", active_apps=apps())
    status = read_ray_service(partial, active_cluster=made_by_kuberay(two, "svc-old12"))
    assert status.phase is ServicePhase.DEPLOYING and "not reported yet: other" in status.message
    assert read_ray_service(with_status(V1), active_cluster=None).message == "KubeRay has not created a RayCluster yet"


def test_another_promotion_wins() -> None:
    status = read_ray_service(with_status(V2, active="svc-new34", active_apps=apps()), active_cluster=NEW, version="v1")
    assert status.phase is ServicePhase.FAILED and "now asks for version 'v2', not 'v1'" in status.message


def serve_record(version: str) -> dict[str, Any]:
    return {"model": {"status": "RUNNING", "deployed_app_config": {
        "name": "model", "import_path": "serving.model:build_app", "args": {"model_version": version}}}}


def test_in_place_needs_serves_own_record() -> None:
    in_place = spec("v2", current=V1, in_place=True)
    service = with_status(in_place, active="svc-old12", active_apps=apps())
    cluster = made_by_kuberay(V1, "svc-old12")
    unconfirmed = read_ray_service(service, active_cluster=cluster)
    assert unconfirmed.phase is ServicePhase.DEPLOYING and unconfirmed.refresh
    assert "waiting for Serve to confirm the in-place update" in unconfirmed.message
    old = read_ray_service(service, active_cluster=cluster, serve_applications=serve_record("v1"))
    assert old.phase is ServicePhase.DEPLOYING and "Serve does not run the spec's config of model yet" in old.message
    new = read_ray_service(service, active_cluster=cluster, serve_applications=serve_record("v2"))
    assert new.phase is ServicePhase.RUNNING and new.active_version == "v2"


def test_round_trip() -> None:
    service = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps(TinyModel=("HEALTHY", "")),
                          pending="svc-new34", pending_apps=apps("DEPLOYING", TinyModel=("UPDATING", "waiting")))
    status = read_ray_service(service, active_cluster=OLD, pending_cluster=NEW)
    assert ServiceStatus.from_dict(status.to_dict()) == status
    assert status.to_dict()["phase"] == "UPGRADING"
    # Plain JSON: lists, not tuples (Airflow would store a tuple as a tagged object in the XCom).
    data = status.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert isinstance(data["applications"], list) and isinstance(data["applications"][0]["deployments"], list)


def test_diagnosis_names_deployment_replicas_cluster_and_topology() -> None:
    service = with_status(V2, upgrading=True, active="svc-old12", active_apps=apps(),
                          pending="svc-new34", pending_apps=apps("DEPLOYING", TinyModel=(
                              "UPDATING", "Deployment 'TinyModel' in application 'model' has 1 replicas that have "
                                          "taken more than 30s to be scheduled.")))
    status = read_ray_service(service, active_cluster=OLD, pending_cluster=NEW)
    serve = {"model": {"deployments": {"TinyModel": {
        "target_num_replicas": 2, "required_resources": {"CPU": 0.1, "TPU": 64},
        "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}]}}}}
    text = diagnose_ray_service(status, waited=42.4, serve_applications=serve,
                                cluster_diagnosis="PROVISIONING: head ready; 0 of 4 TPU hosts ready",
                                config_problems=["applications['model'].deployments['TinyModel']...: asks for 64"])
    lines = text.splitlines()
    assert lines[0].startswith("UPGRADING: preparing new RayCluster svc-new34") and "(deploying for 42 s)" in lines[0]
    assert "- application 'model' DEPLOYING on pending RayCluster svc-new34" in text
    assert "  - deployment 'TinyModel' UPDATING: Deployment 'TinyModel' in application 'model' has 1 replicas" in text
    assert ("  - deployment 'TinyModel': 1 replica(s) waiting to start (1 STARTING), 1 RUNNING, 2 wanted; "
            'each replica needs {"CPU": 0.1, "TPU": 64}') in text
    assert "RayCluster svc-new34 (pending):\n  PROVISIONING: head ready; 0 of 4 TPU hosts ready" in text
    assert "Serve config problems" in text and "asks for 64" in text
    clean = diagnose_ray_service(status)
    assert clean.endswith("every multi-host replica declares its slice topology or its bundles")
    assert describe_replicas(
        {"deployments": {"D": {"target_num_replicas": 1, "replicas": [{"state": "RUNNING"}]}}}) == []
    # A rollout: the old replica still RUNNING, the new one waiting for resources.
    assert describe_replicas({"deployments": {"D": {"target_num_replicas": 1, "replicas": [
        {"state": "RUNNING"}, {"state": "STARTING"}]}}}) == [
        "deployment 'D': 1 replica(s) waiting to start (1 STARTING), 1 RUNNING, 1 wanted"]


def test_deploying_clock_counts_only_deploying_on_the_target_cluster() -> None:
    clock = ApplicationClock(limit=10)
    provisioning = with_status(V1, ready=False, pending="svc-old12")
    clock.update(read_ray_service(provisioning, pending_cluster=OLD), now=0)
    assert clock.seconds_left(0) is None
    deploying = read_ray_service(with_status(V1, ready=False, pending="svc-old12", pending_apps=apps("DEPLOYING")),
                                 pending_cluster=OLD)
    clock.update(deploying, now=5)
    clock.update(deploying, now=14)
    assert clock.overdue(14) is None and clock.seconds_left(14) == 1
    assert clock.overdue(15) == ("model", 10)
    clock.update(read_ray_service(with_status(V1, active="svc-old12", active_apps=apps()), active_cluster=OLD), now=16)
    assert clock.overdue(100) is None
    assert ApplicationClock(None).overdue(1e9) is None
