"""Airflow conventions in real DAG runs (dag.test) against a Kubernetes API over HTTP.

Deferrable only where the deployment says so, the cluster reference taken whole by every
task (also as older versions wrote it), and a transient KubeRay reconcile failure waited out.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.support.airflow_runner import run_dag
from tests.support.fake_apiserver.kuberay import KubeRayReactor, replica_failure
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE, raytpu_connection

pytestmark = pytest.mark.timeout(120)

LIFECYCLE = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="4x4")
    cluster = "{{{{ ti.xcom_pull('create_cluster')['cluster_name'] }}}}"
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=cluster, timeout=60, poke_interval=0.5)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=cluster)
    create >> ready >> delete.as_teardown(setups=create)
'''


def test_without_default_deferrable_the_sensor_pokes_in_the_worker(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment without a triggerer ([operators] default_deferrable = False, Airflow's default) must not
    wait forever for a trigger nobody runs."""
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    with KubeRayReactor(kube, delay=1.0, stagger=0.05):
        outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="no_triggerer"), "no_triggerer")
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "delete_cluster": "success"}
    assert kube.count("GET", r"/rayclusters$", watch=True) == 0, "nothing deferred to a triggerer"


def test_a_replica_failure_that_clears_does_not_fail_the_sensor(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    """KubeRay sets ReplicaFailure on a reconcile error (a quota) and clears it on the next good reconcile."""
    kuberay.set_mode(replica_failure(message='pods "w" is forbidden: exceeded quota: tpu-quota'))

    def raise_the_quota() -> None:
        kube.wait_for(lambda: kube.count("GET", r"/rayclusters$", watch=True) >= 1, 60)
        kuberay.set_mode("auto")

    thread = threading.Thread(target=raise_the_quota, daemon=True)
    thread.start()
    outcome = run_dag(airflow_home, LIFECYCLE.format(dag_id="quota"), "quota")
    thread.join(10)
    assert outcome["wait_ready"].state == "success" and outcome["wait_ready"].try_number == 1
    log = capfd.readouterr().out
    assert "KubeRay cannot reconcile it since " in log and "(FailedCreateWorkerPod: pods \"w\" is forbidden" in log


REFERENCES = '''
from datetime import datetime
from airflow.sdk import DAG, task
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("references", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2",
                                      raytpu_conn_id="raytpu_team")
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=60, poke_interval=0.5)

    @task
    def written_by_an_older_version(reference: dict) -> dict:
        return {"cluster_name": reference["cluster_name"], "namespace": reference["namespace"],
                "conn_id": reference["raytpu_conn_id"]}

    older = written_by_an_older_version(create.output)
    ready_again = RayClusterReadySensor(task_id="wait_ready_again", cluster=older, timeout=60, poke_interval=0.5)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster=create.output)
    ready >> ready_again >> delete.as_teardown(setups=create)
'''


def test_every_cluster_task_takes_the_reference_whole(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference carries the name, the namespace and the connection: nothing to template, and the
    connection key of older versions (``conn_id``) is still read, with a deprecation warning."""
    from airflow.exceptions import AirflowProviderDeprecationWarning

    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_TEAM", raytpu_connection(namespace="team"))
    with pytest.warns(AirflowProviderDeprecationWarning, match="A cluster reference's 'conn_id' is deprecated: it is "
                                                               "'raytpu_conn_id'"):
        outcome = run_dag(airflow_home, REFERENCES, "references")
    assert {task: o.state for task, o in outcome.items()} == {
        "create_cluster": "success", "wait_ready": "success", "written_by_an_older_version": "success",
        "wait_ready_again": "success", "delete_cluster": "success"}
    reference = outcome["create_cluster"].result
    assert (reference["namespace"], reference["raytpu_conn_id"]) == ("team", "raytpu_team")
    assert "conn_id" not in reference
    assert outcome["delete_cluster"].result["cluster_names"] == [reference["cluster_name"]]
    assert kube.list_objects("rayclusters", "team") == [] and kube.list_objects("rayclusters", NAMESPACE) == []
    assert json.loads(json.dumps(reference)) == reference, "plain JSON"
