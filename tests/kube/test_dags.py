"""Real DAG runs (dag.test) against a Kubernetes API over HTTP: create -> ready (deferred) -> delete."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_provider_raytpu.manifests.raycluster import EXPIRES_AT_ANNOTATION, format_expiry
from tests.airflow_runner import run_dag
from tests.fakekube.kuberay import KubeRayReactor
from tests.fakekube.server import FakeKubeApiServer
from tests.kube.conftest import NAMESPACE

pytestmark = pytest.mark.timeout(120)

LIFECYCLE = '''
from datetime import datetime
from airflow.sdk import DAG, Param
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1),
         default_args={{"retries": 2, "retry_delay": 0}},
         params={{"accelerator": Param("v6e"), "topology": Param("4x4"), "slices": Param("1"), "spot": Param("false")}}):
    create = CreateRayClusterOperator(
        task_id="create_cluster", cluster_name="nightly_train",
        accelerator="{{{{ params.accelerator }}}}", topology="{{{{ params.topology }}}}",
        num_slices="{{{{ params.slices }}}}", spot="{{{{ params.spot }}}}",
    )
    cluster = "{{{{ ti.xcom_pull('create_cluster')['cluster_name'] }}}}"
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=cluster, timeout=60, poll_interval=1)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=cluster, wait_for_deletion=True)
    create >> ready >> delete.as_teardown(setups=create)
'''


def test_create_ready_delete_with_ui_string_params(airflow_home: Path, connections: None,
                                                   kube: FakeKubeApiServer) -> None:
    # Slow enough that the sensor defers and the trigger's watch sees the hosts come up.
    with KubeRayReactor(kube, delay=2.0, stagger=0.05):
        outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="lifecycle"), "lifecycle",
                          conf={"accelerator": "TPU-V6E", "topology": "4x4", "slices": "2", "spot": "false"})
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    reference = outcome["create_cluster"].result
    assert reference == {
        "cluster_name": "nightly-train",
        "namespace": NAMESPACE,
        "conn_id": "raytpu_default",
        "tpu": {"accelerator": "v6e", "topology": "4x4", "num_slices": 2, "spot": False, "chips_per_host": None},
        "dashboard_url": f"{kube.url}/api/v1/namespaces/{NAMESPACE}/services/nightly-train-head-svc:dashboard/proxy",
    }
    assert outcome["wait_ready"].result["ready_hosts"] == 8
    assert kube.count("GET", r"/rayclusters$", watch=True) >= 1, "the sensor should have deferred to the watch"
    assert kube.get_object("rayclusters", NAMESPACE, "nightly-train") is None
    assert kube.list_objects("v1/pods", NAMESPACE) == []


def test_bad_slice_fails_before_any_api_call(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="bad_slice"), "bad_slice",
                      conf={"accelerator": "v6e", "topology": "16", "slices": "1", "spot": "false"})
    # Bad input is not retried (retries=2 in the DAG), and nothing reached the API server.
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert kube.count("POST") == 0
    # The teardown's only setup failed, so there is nothing to tear down.
    assert outcome["delete_cluster"].state == "upstream_failed"


EXPIRED = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteExpiredRayClustersOperator

with DAG("janitor", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteExpiredRayClustersOperator(task_id="delete_expired")
'''


def test_expired_clusters_are_deleted(airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    now = datetime.now(timezone.utc)
    for name, expiry in (("old", now - timedelta(minutes=1)), ("fresh", now + timedelta(hours=1))):
        kube.create_object(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                             expires_at=expiry))
    unmanaged = build_ray_cluster(name="unmanaged", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"))
    unmanaged["metadata"]["labels"] = {}
    unmanaged["metadata"]["annotations"][EXPIRES_AT_ANNOTATION] = format_expiry(now - timedelta(days=1))
    kube.create_object(unmanaged)
    outcome = run_dag(airflow_home, EXPIRED, "janitor")
    assert outcome["delete_expired"].result == [f"{NAMESPACE}/old"]
    assert sorted(c["metadata"]["name"] for c in kube.list_objects("rayclusters", NAMESPACE)) == ["fresh", "unmanaged"]

