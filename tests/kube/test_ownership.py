"""Many DAGs, one namespace: names, ownership and teardown, with real DAG runs (dag.test) over HTTP.

Scheduled runs of one date have the same run id in every DAG, so these tests run their DAGs
for one logical date, as a scheduler would.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.airflow_runner import run_dag
from tests.fakekube.kuberay import KubeRayReactor
from tests.fakekube.server import FakeKubeApiServer
from tests.kube.conftest import NAMESPACE

pytestmark = pytest.mark.timeout(120)

LOGICAL_DATE = datetime(2026, 12, 2, tzinfo=timezone.utc)
CLUSTERS = r"/apis/ray\.io/v1/namespaces/ml/rayclusters"

DAG = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator

with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2", {create})
    {teardown}
'''
BY_XCOM = ("delete = DeleteRayClusterOperator(task_id='delete_cluster', "
           "cluster_name=\"{{ ti.xcom_pull('create_cluster')['cluster_name'] }}\")\n"
           "    create >> delete.as_teardown(setups=create)")
BY_OWNER = ("delete = DeleteRayClusterOperator(task_id='delete_cluster')\n"
            "    create >> delete.as_teardown(setups=create)")


def source(dag_id: str, create: str = "", teardown: str = "") -> str:
    return DAG.format(dag_id=dag_id, create=create, teardown=teardown)


def cluster_names(kube: FakeKubeApiServer) -> list[str]:
    return sorted(c["metadata"]["name"] for c in kube.list_objects("rayclusters", NAMESPACE))


def test_two_dags_whose_ids_read_the_same_each_get_and_delete_their_own_cluster(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    first = run_dag(airflow_home, source("etl_daily"), "etl_daily", logical_date=LOGICAL_DATE)
    second = run_dag(airflow_home, source("etl.daily", teardown=BY_XCOM), "etl.daily", logical_date=LOGICAL_DATE)
    assert first["create_cluster"].state == second["create_cluster"].state == "success"
    mine, theirs = first["create_cluster"].result["cluster_name"], second["create_cluster"].result["cluster_name"]
    assert mine != theirs, "the same default name for two DAGs: the second adopted the first's cluster"
    assert mine.startswith("etl-daily-create-cluster-") and theirs.startswith("etl-daily-create-cluster-")
    assert second["delete_cluster"].result["deleted"] is True
    assert cluster_names(kube) == [mine], "the second DAG's teardown deleted only its own cluster"
    notes = kube.get_object("rayclusters", NAMESPACE, mine)["metadata"]["annotations"]
    assert (notes["raytpu.dev/dag-id"], notes["raytpu.dev/task-id"]) == ("etl_daily", "create_cluster")
    assert notes["raytpu.dev/run-id"] == f"manual__{LOGICAL_DATE.isoformat()}", "both DAGs ran with this run id"


def test_a_same_named_cluster_of_another_dag_is_a_conflict_naming_its_owner_and_is_left_alone(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    named = "cluster_name='shared'"
    assert run_dag(airflow_home, source("team_a", named), "team_a",
                   logical_date=LOGICAL_DATE)["create_cluster"].state == "success"
    before = kube.get_object("rayclusters", NAMESPACE, "shared")
    outcome = run_dag(airflow_home, source("team_b", named, BY_XCOM), "team_b", logical_date=LOGICAL_DATE)
    # Same name, same spec, same run id: still not adopted. Not retried: no retry can fix it.
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    log = capfd.readouterr().out
    assert (f"RayCluster 'shared' in namespace 'ml' belongs to DAG 'team_a', run 'manual__{LOGICAL_DATE.isoformat()}', "
            "task 'create_cluster', not to this task (DAG 'team_b'") in log
    after = kube.get_object("rayclusters", NAMESPACE, "shared")
    assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"], "team_b's teardown left it"
    assert kube.count("DELETE", CLUSTERS) == 0


def test_a_create_that_fails_after_applying_is_still_torn_down(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    # Every create request lands, but its answer is lost: the task fails (no retries left) with the cluster
    # applied and no XCom. The teardown runs anyway and finds the cluster by its owner labels.
    kube.lose_answers("POST", CLUSTERS + "$", times=None)
    outcome = run_dag(airflow_home, source("lost_answers", teardown=BY_OWNER), "lost_answers",
                      logical_date=LOGICAL_DATE)
    assert (outcome["create_cluster"].state, outcome["create_cluster"].try_number) == ("failed", 1)
    assert outcome["create_cluster"].result is None
    assert kube.count("POST", CLUSTERS + "$") >= 2, "the cluster was applied"
    assert outcome["delete_cluster"].state == "success"
    (name,) = outcome["delete_cluster"].result["cluster_names"]
    assert name.startswith("lost-answers-create-cluster-") and outcome["delete_cluster"].result["deleted"] is True
    assert cluster_names(kube) == []
    assert f"1 RayCluster(s) of this DAG run made by task(s) create_cluster in namespace ml: {name}" in capfd.readouterr().out


def test_the_teardown_by_owner_deletes_only_its_own_create_tasks_clusters(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    two = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator

with DAG("two_clusters", schedule=None, start_date=datetime(2026, 1, 1)):
    train = CreateRayClusterOperator(task_id="create_train", accelerator="v6e", topology="2x2")
    serve = CreateRayClusterOperator(task_id="create_serve", accelerator="v6e", topology="2x2")
    done_training = DeleteRayClusterOperator(task_id="delete_train")
    train >> done_training.as_teardown(setups=train)
    serve
'''
    outcome = run_dag(airflow_home, two, "two_clusters", logical_date=LOGICAL_DATE)
    train, serve = outcome["create_train"].result["cluster_name"], outcome["create_serve"].result["cluster_name"]
    assert train != serve
    assert outcome["delete_train"].result["cluster_names"] == [train]
    assert cluster_names(kube) == [serve]


def test_a_rayservices_clusters_are_never_taken_for_this_runs_own(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer) -> None:
    """KubeRay copies a RayService's labels to its clusters: owner labels of this very DAG run included."""
    from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    run_id = f"manual__{LOGICAL_DATE.isoformat()}"
    served = build_ray_cluster(name="chat-x7k2p", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                               origin=AirflowOrigin("sweep", run_id, "deploy"))
    served["metadata"]["labels"]["ray.io/originated-from-cr-name"] = "chat"
    kube.create_object(served)
    sweep = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator

with DAG("sweep", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteRayClusterOperator(task_id="delete_all_of_this_run")
'''
    outcome = run_dag(airflow_home, sweep, "sweep", logical_date=LOGICAL_DATE)
    assert outcome["delete_all_of_this_run"].result["cluster_names"] == []
    assert cluster_names(kube) == ["chat-x7k2p"]
