"""A check followed by an act, raced: the fake API server replaces or changes the object just before the delete
arrives, and the delete, carrying the checked object's uid (and resourceVersion where the decision read more
than the owner), is refused instead of taking the new one. And the sweep of expired clusters fails closed.

Real DAG runs (dag.test) against the fake API server over HTTP.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_raytpu.hooks.raytpu import default_deployment
from airflow_provider_raytpu.manifests.raycluster import (
    EXPIRES_AT_ANNOTATION,
    AirflowOrigin,
    build_ray_cluster,
    format_expiry,
)
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.airflow_runner import run_dag
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

pytestmark = pytest.mark.timeout(120)

LOGICAL_DATE = datetime(2026, 12, 2, tzinfo=UTC)
RUN_ID = f"manual__{LOGICAL_DATE.isoformat()}"
CLUSTER = r"/apis/ray\.io/v1/namespaces/ml/rayclusters/nightly$"

TEARDOWN = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator

with DAG("race", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    DeleteRayClusterOperator(task_id="delete_cluster", created_by="create_cluster"{name})
'''
FALLBACK = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("race", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    CreateRayClusterOperator(task_id="create_cluster", cluster_name="nightly", accelerator="v6e", topology="2x2",
                             capacity=["reservation:used-up", "spot"], fallback_after=2)
'''
SWEEP = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteExpiredRayClustersOperator

with DAG("janitor", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteExpiredRayClustersOperator(task_id="delete_expired")
'''


def nightly(dag_id: str = "race", run_id: str = RUN_ID, expires_at: datetime | None = None) -> dict[str, Any]:
    return build_ray_cluster(name="nightly", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                             origin=AirflowOrigin(dag_id, run_id, "create_cluster", deployment=default_deployment()),
                             expires_at=expires_at)


def replace_with(kube: FakeKubeApiServer, manifest: dict[str, Any]) -> None:
    """What another DAG does in the window: the cluster is deleted and a same-named one made."""
    kube.delete_object("rayclusters", NAMESPACE, "nightly", force=True)
    kube.create_object(manifest)


def with_ready_head(kube: FakeKubeApiServer, name: str) -> None:
    kube.set_status("rayclusters", NAMESPACE, name, {"state": "ready", "conditions": [
        {"type": "HeadPodReady", "status": "True", "reason": "HeadPodRunningAndReady",
         "lastTransitionTime": "2026-12-02T00:00:00Z"}]})


@pytest.mark.parametrize("name", [", cluster_name='nightly'", ""], ids=["by-name", "by-owner"])
def test_a_teardown_never_deletes_a_cluster_made_after_its_owner_check(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, name: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    kube.create_object(nightly())
    theirs = nightly(dag_id="other_team")
    kube.before("DELETE", CLUSTER, lambda: replace_with(kube, theirs))
    outcome = run_dag(airflow_home, TEARDOWN.format(name=name), "race", logical_date=LOGICAL_DATE)
    assert outcome["delete_cluster"].state == "success"
    assert outcome["delete_cluster"].result == {"cluster_name": "nightly", "cluster_names": [], "namespace": NAMESPACE,
                                                "deleted": False, "skipped": ["nightly"]}
    survivor = kube.get_object("rayclusters", NAMESPACE, "nightly")
    assert survivor is not None and survivor["metadata"]["annotations"]["raytpu.dev/dag-id"] == "other_team"
    assert kube.count("DELETE", CLUSTER) == 1, "the refused delete was not retried"
    log = capfd.readouterr().out
    assert ('RayCluster ml/nightly changed since it was checked: not deleted (Operation cannot be fulfilled on '
            'rayclusters.ray.io "nightly": Precondition failed: UID in precondition') in log
    assert "It was replaced or changed after its owner was checked, so it is left alone" in log
    assert "no chip-hours" not in log, "a cluster this teardown did not delete has no usage of its own here"


def test_the_sweep_never_deletes_a_cluster_whose_expiry_was_renewed_after_it_was_listed(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    kube.create_object(nightly(expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    renewed = format_expiry(datetime.now(UTC) + timedelta(hours=1))
    kube.before("DELETE", CLUSTER, lambda: kube.patch_object(  # a retry of its create adopted it meanwhile
        "rayclusters", NAMESPACE, "nightly", {"metadata": {"annotations": {EXPIRES_AT_ANNOTATION: renewed}}}))
    assert run_dag(airflow_home, SWEEP, "janitor")["delete_expired"].result == []
    stored = kube.get_object("rayclusters", NAMESPACE, "nightly")
    assert stored is not None and stored["metadata"]["annotations"][EXPIRES_AT_ANNOTATION] == renewed
    log = capfd.readouterr().out
    assert ("RayCluster ml/nightly changed since it was checked: not deleted (Operation cannot be fulfilled on "
            'rayclusters.ray.io "nightly": Precondition failed: ResourceVersion in precondition') in log


def test_the_sweep_deletes_an_expired_cluster_whose_run_was_deleted(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    kube.create_object(nightly(run_id="scheduled__2026-11-01T00:00:00+00:00",
                               expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    assert run_dag(airflow_home, SWEEP, "janitor")["delete_expired"].result == [f"{NAMESPACE}/nightly"]
    assert kube.get_object("rayclusters", NAMESPACE, "nightly") is None
    assert "RayCluster ml/nightly: its head is not ready, so no Ray job runs there" in capfd.readouterr().out


@pytest.mark.parametrize("refusal", ["503", "403"])
def test_the_sweep_keeps_an_expired_cluster_whose_ray_jobs_cannot_be_listed(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, refusal: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    kube.create_object(build_ray_cluster(name="busy", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                         expires_at=datetime.now(UTC) - timedelta(minutes=5)))
    with_ready_head(kube, "busy")
    if refusal == "403":  # the ClusterRole lacks services/proxy in this namespace
        kube.deny("create", "services/proxy")
        kube.deny("get", "services/proxy")
    else:  # the service proxy has no endpoint to answer (its default without a registration): 503
        kube.inject(None, r"/services/busy-head-svc:dashboard/proxy/", 503, times=None)
    assert run_dag(airflow_home, SWEEP, "janitor")["delete_expired"].result == []
    assert kube.get_object("rayclusters", NAMESPACE, "busy") is not None
    assert kube.count("DELETE", r"/rayclusters/") == 0
    log = capfd.readouterr().out
    assert "RayCluster ml/busy expired at" in log and "but is not deleted: its Ray jobs could not be listed (" in log
    assert "kept until they can. The connection's identity needs 'create' on services/proxy in namespace ml" in log


def test_a_capacity_fallback_never_deletes_a_cluster_made_after_its_owner_check(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, capfd: pytest.CaptureFixture[str]) -> None:
    """No node takes the reservation (no KubeRay here places a host): after fallback_after the task gives the
    cluster up; another DAG's same-named cluster made just before the delete is refused, not deleted."""
    theirs = nightly(dag_id="other_team")
    kube.before("DELETE", CLUSTER, lambda: replace_with(kube, theirs))
    outcome = run_dag(airflow_home, FALLBACK, "race", logical_date=LOGICAL_DATE)
    assert outcome["create_cluster"].state == "failed"
    survivor = kube.get_object("rayclusters", NAMESPACE, "nightly")
    assert survivor is not None and survivor["metadata"]["annotations"]["raytpu.dev/dag-id"] == "other_team"
    assert kube.count("DELETE", CLUSTER) == 1 and kube.count("POST", r"/rayclusters$") == 1
    assert ("RayCluster ml/nightly changed since it was checked: not deleted (Operation cannot be fulfilled on "
            'rayclusters.ray.io "nightly": Precondition failed: UID in precondition') in capfd.readouterr().out
