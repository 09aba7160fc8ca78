"""The KubeRay backend over real HTTP: create/adopt/conflict/update, delete, retries, listing, dashboard URLs."""

from __future__ import annotations

import pytest

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.errors import ConflictError, FatalError
from airflow_provider_raytpu.hooks.raytpu import ConnectionNotFoundError, RayTpuHook
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

CLUSTERS = r"/apis/ray\.io/v1/namespaces/ml/rayclusters"


def manifest(name: str = "train", **kwargs: object) -> dict:
    args = {"tpu": TpuSlice("v6e", "4x4", num_slices=2), "origin": AirflowOrigin("nightly", "run-1", "create")}
    return build_ray_cluster(name=name, namespace=NAMESPACE, **{**args, **kwargs})  # type: ignore[arg-type]


def creates(kube: FakeKubeApiServer) -> int:
    return kube.count("POST", CLUSTERS + "$")


def test_create_then_adopt_on_retry(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    first = backend.apply_cluster(manifest())
    again = backend.apply_cluster(manifest(origin=AirflowOrigin("nightly", "run-1", "create")))
    assert (first.action, again.action) == (Applied.CREATED, Applied.ADOPTED)
    assert creates(kube) == 1
    stored = kube.get_object("rayclusters", NAMESPACE, "train")
    assert stored["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 4
    post = next(r for r in kube.requests if r.method == "POST")
    assert post.query.get("fieldValidation") == "Strict"


def test_different_spec_is_a_conflict_naming_the_owner(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    backend.apply_cluster(manifest())
    with pytest.raises(ConflictError) as info:
        backend.apply_cluster(manifest(tpu=TpuSlice("v6e", "4x8")))
    assert "'train'" in str(info.value) and "DAG 'nightly'" in str(info.value)
    assert "update_if_exists=True" in str(info.value)
    assert creates(kube) == 1


def test_a_same_named_cluster_this_provider_did_not_make_is_never_adopted(backend: KubeRayBackend,
                                                                           kube: FakeKubeApiServer) -> None:
    foreign = manifest()
    foreign["metadata"]["labels"] = {}
    kube.create_object(foreign)
    with pytest.raises(ConflictError, match="RayCluster 'train' in namespace 'ml' already exists and was not made by "
                                            "this provider"):
        backend.apply_cluster(manifest(), update_if_exists=True)
    assert creates(kube) == 0 and kube.count("PUT", CLUSTERS) == 0


def test_update_if_exists_recreates_the_cluster(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    # KubeRay v1.5 has no RayCluster upgradeStrategy: a PUT of a new spec leaves the old pods running.
    first = backend.apply_cluster(manifest()).cluster
    result = backend.apply_cluster(manifest(tpu=TpuSlice("v6e", "4x8")), update_if_exists=True)
    assert result.action is Applied.RECREATED
    stored = kube.get_object("rayclusters", NAMESPACE, "train")
    assert stored["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 8
    assert stored["metadata"]["uid"] != first["metadata"]["uid"], "a new object, not the old one updated"
    assert kube.count("PUT", CLUSTERS) == 0
    assert kube.count("DELETE", CLUSTERS + "/train$") == 1 and creates(kube) == 2


def test_transient_errors_are_retried_without_duplicates(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    kube.inject("POST", CLUSTERS + "$", 503, times=2)
    kube.inject("POST", CLUSTERS + "$", 429, retry_after=0)
    kube.reset_connection("POST", CLUSTERS + "$")
    assert backend.apply_cluster(manifest()).action is Applied.CREATED
    assert creates(kube) == 5
    assert len(kube.list_objects("rayclusters", NAMESPACE)) == 1


def test_lost_create_answer_adopts_what_the_first_attempt_made(backend: KubeRayBackend,
                                                               kube: FakeKubeApiServer) -> None:
    # The create landed but its answer was lost: the retried POST gets 409 and adopts it.
    kube.create_object(manifest())
    assert backend.get_cluster("train", NAMESPACE) is not None
    kube.inject("GET", CLUSTERS + "/train$", 404)  # the first read raced the create
    assert backend.apply_cluster(manifest()).action is Applied.ADOPTED


def test_other_client_errors_are_not_retried(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    kube.inject("POST", CLUSTERS + "$", 422, message="spec.workerGroupSpecs[0].replicas: Invalid value")
    with pytest.raises(FatalError, match="refused to create"):
        backend.apply_cluster(manifest())
    assert creates(kube) == 1


def test_delete_is_idempotent(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    backend.apply_cluster(manifest())
    assert backend.delete_cluster("train", NAMESPACE) is True
    assert backend.delete_cluster("train", NAMESPACE) is False
    assert backend.get_cluster("train", NAMESPACE) is None


def test_list_by_label(backend: KubeRayBackend, kube: FakeKubeApiServer) -> None:
    backend.apply_cluster(manifest("a"))
    backend.apply_cluster(manifest("b"))
    kube.create_object({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                        "metadata": {"name": "someone-elses", "namespace": NAMESPACE}, "spec": {"headGroupSpec": {}}})
    mine = backend.list_clusters(NAMESPACE, "app.kubernetes.io/managed-by=airflow-provider-raytpu")
    assert sorted(c["metadata"]["name"] for c in mine) == ["a", "b"]
    assert len(backend.list_clusters(None, "app.kubernetes.io/managed-by=airflow-provider-raytpu")) == 2


def test_dashboard_urls(backend: KubeRayBackend, kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend.dashboard("train", "ml").url == (
        f"{kube.url}/api/v1/namespaces/ml/services/train-head-svc:dashboard/proxy"
    )
    from tests.support.kube_connection import raytpu_connection

    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(dashboard="dns", insecure_dashboard_http=True))
    assert RayTpuHook().backend.dashboard("train", "ml").url == "http://train-head-svc.ml.svc.cluster.local:8265"
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT",
                       raytpu_connection(dashboard="url", dashboard_url="https://ray.example.com/{namespace}/{cluster_name}"))
    assert RayTpuHook().backend.dashboard("train", "ml").url == "https://ray.example.com/ml/train"
    assert kube.token not in backend.dashboard("train", "ml").url


def test_test_connection(connections: None, kube: FakeKubeApiServer) -> None:
    ok, message = RayTpuHook().test_connection()
    assert ok and kube.url in message and "'ml'" in message
    kube.deny("list", "rayclusters")
    ok, message = RayTpuHook().test_connection()
    assert not ok and "may not list" in message


def test_missing_connection_says_how_to_make_one() -> None:
    with pytest.raises(ConnectionNotFoundError) as info:
        _ = RayTpuHook("no_such_conn").backend
    assert "AIRFLOW_CONN_RAYTPU_DEFAULT" in str(info.value) and '"backend": "local"' in str(info.value)


def test_test_connection_warns_of_another_deployments_objects_for_this_deployments_dags(
        connections: None, kube: FakeKubeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging and prod share a namespace and DAG ids: prod's Test button names staging's objects of prod's DAGs
    (the DAG ids from prod's metadata database), not those of DAGs prod does not have, nor its own."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.utils.session import create_session

    from tests.support.airflow_runner import ensure_airflow_db
    from tests.support.kube_connection import raytpu_connection

    ensure_airflow_db()
    with create_session() as session:
        session.merge(DagBundleModel(name="dags-folder"))
        session.flush()
        session.merge(DagModel(dag_id="nightly", bundle_name="dags-folder", fileloc="/dags/nightly.py"))
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", raytpu_connection(deployment="prod"))
    backend = RayTpuHook().backend
    for name, dag, deployment in (("staging-nightly", "nightly", "staging"),
                                  ("staging-only", "staging_only", "staging"), ("prod-nightly", "nightly", "prod")):
        backend.apply_cluster(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"),
                                                origin=AirflowOrigin(dag, "run-1", "create", deployment=deployment)))
    ok, message = RayTpuHook().test_connection()
    assert ok, message
    assert "This Airflow deployment records itself as 'prod'" in message
    assert ("Warning: namespace 'ml' holds objects another Airflow deployment made for DAG ids this deployment has "
            "too (staging: nightly).") in message
