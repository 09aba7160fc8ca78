"""Many DAGs, one namespace: names, ownership and teardown, with real DAG runs (dag.test) over HTTP.

Scheduled runs of one date have the same run id in every DAG, so these tests run their DAGs
for one logical date, as a scheduler would.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from airflow_provider_raytpu.hooks.raytpu import default_deployment
from tests.support.airflow_runner import run_dag
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

pytestmark = pytest.mark.timeout(120)

LOGICAL_DATE = datetime(2026, 12, 2, tzinfo=UTC)
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
            f"task 'create_cluster', deployment '{default_deployment()}', not to this task (DAG 'team_b'") in log
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
    assert (f"1 RayCluster(s) of this DAG run made by task(s) create_cluster in namespace ml: {name}"
            in capfd.readouterr().out)


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
                               origin=AirflowOrigin("sweep", run_id, "deploy", deployment=default_deployment()))
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


def test_a_named_teardown_leaves_an_overlapping_runs_cluster_alone_unless_forced(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Two overlapping runs of a DAG with a literal cluster_name: run 2's create conflicts, and its all_done
    teardown must not delete run 1's cluster mid-training."""
    from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    first_run = "scheduled__2026-12-01T00:00:00+00:00"
    kube.create_object(build_ray_cluster(name="nightly", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                         origin=AirflowOrigin("overlap", first_run, "create_cluster",
                                                              deployment=default_deployment())))
    before = kube.get_object("rayclusters", NAMESPACE, "nightly")
    named = "cluster_name='nightly'"
    by_name = ("delete = DeleteRayClusterOperator(task_id='delete_cluster', cluster_name='nightly'{force})\n"
               "    create >> delete.as_teardown(setups=create)")
    outcome = run_dag(airflow_home, source("overlap", named, by_name.format(force="")), "overlap",
                      logical_date=LOGICAL_DATE)
    assert outcome["create_cluster"].state == "failed"
    assert outcome["delete_cluster"].state == "success"
    assert outcome["delete_cluster"].result == {"cluster_name": "nightly", "cluster_names": [], "namespace": NAMESPACE,
                                                "deleted": False, "skipped": ["nightly"]}
    assert kube.count("DELETE", CLUSTERS) == 0
    assert kube.get_object("rayclusters", NAMESPACE, "nightly")["metadata"]["uid"] == before["metadata"]["uid"]
    log = capfd.readouterr().out
    assert (f"Not deleting RayCluster ml/nightly: it belongs to DAG 'overlap', run '{first_run}', task "
            f"'create_cluster', deployment '{default_deployment()}', not to task(s) create_cluster of this DAG run. "
            "It may still be in use; pass force=True to delete it anyway") in log

    forced = run_dag(airflow_home, source("overlap", named, by_name.format(force=", force=True")), "overlap",
                     logical_date=LOGICAL_DATE.replace(day=3))
    assert forced["delete_cluster"].result["deleted"] is True
    assert cluster_names(kube) == []


def test_a_named_teardown_of_a_cluster_this_provider_did_not_make_leaves_it_alone(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    from airflow_provider_raytpu.manifests.raycluster import MANAGED_BY_LABEL, build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    theirs = build_ray_cluster(name="hand-made", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"))
    del theirs["metadata"]["labels"][MANAGED_BY_LABEL]
    kube.create_object(theirs)
    sweep = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteRayClusterOperator

with DAG("hand_made", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteRayClusterOperator(task_id="delete_cluster", cluster_name="hand-made")
'''
    outcome = run_dag(airflow_home, sweep, "hand_made", logical_date=LOGICAL_DATE)
    assert outcome["delete_cluster"].result["skipped"] == ["hand-made"]
    assert cluster_names(kube) == ["hand-made"]
    assert "it belongs to no task of this provider (it has no managed-by label)" in capfd.readouterr().out


MAPPED = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator

with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    create = CreateRayClusterOperator.partial(task_id="create_cluster", accelerator="v6e", {name}).expand(
        topology=["2x2", "2x2"])
    delete = DeleteRayClusterOperator(task_id="delete_cluster")
    create >> delete.as_teardown(setups=create)
'''


def test_map_indexes_that_resolve_to_one_explicit_name_conflict_naming_both(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        capfd: pytest.CaptureFixture[str]) -> None:
    outcome = run_dag(airflow_home, MAPPED.format(dag_id="mapped_named", name="cluster_name='shared'"),
                      "mapped_named", logical_date=LOGICAL_DATE)
    states = sorted(outcome[f"create_cluster[{i}]"].state for i in (0, 1))
    assert states == ["failed", "success"], "one map index made the cluster; the other did not adopt it"
    won = next(i for i in (0, 1) if outcome[f"create_cluster[{i}]"].state == "success")
    log = capfd.readouterr().out
    run_id = f"manual__{LOGICAL_DATE.isoformat()}"
    here = f"deployment '{default_deployment()}'"
    assert (f"RayCluster 'shared' in namespace 'ml' belongs to DAG 'mapped_named', run '{run_id}', task "
            f"'create_cluster', map index {won}, {here}, not to this task (DAG 'mapped_named', run '{run_id}', task "
            f"'create_cluster', map index {1 - won}, {here})") in log
    assert "Two map indexes of one mapped task resolve to this name" in log
    assert outcome["delete_cluster"].result["cluster_names"] == ["shared"]


def test_each_map_index_of_a_mapped_create_gets_and_tears_down_its_own_cluster(
        airflow_home: Path, connections: None, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    outcome = run_dag(airflow_home, MAPPED.format(dag_id="mapped_default", name=""), "mapped_default",
                      logical_date=LOGICAL_DATE)
    names = [outcome[f"create_cluster[{i}]"].result["cluster_name"] for i in (0, 1)]
    assert len(set(names)) == 2
    for i, name in enumerate(names):
        assert outcome[f"create_cluster[{i}]"].state == "success"
        assert kube.count("DELETE", f"{CLUSTERS}/{name}$") == 1
    assert sorted(outcome["delete_cluster"].result["cluster_names"]) == sorted(names)
    assert cluster_names(kube) == []
