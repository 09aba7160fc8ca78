"""The one apply path (backends/apply.py) over an in-memory store that answers as the API server does.

The store keeps resourceVersions and refuses a stale replace (409) or a second create of a
name (409), so every branch runs against real manifests from the builders: create, a lost
create answer, a foreign object, another owner's object, the same spec, a different spec
with and without update (replaced, or recreated), an object being deleted, a stale write
read again, and an object that keeps changing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from airflow_provider_raytpu.backends.apply import (
    CLUSTER_OWNER,
    SERVICE_OWNER,
    AlreadyExists,
    OnChange,
    StaleWrite,
    apply_object,
    same_service,
    same_spec,
)
from airflow_provider_raytpu.backends.base import Applied, ChangedSinceChecked, Precondition
from airflow_provider_raytpu.errors import ConflictError, FatalError
from airflow_provider_raytpu.manifests.raycluster import MANAGED_BY_LABEL, AirflowOrigin, build_ray_cluster
from airflow_provider_raytpu.manifests.rayservice import build_ray_service, service_version
from airflow_provider_raytpu.tpu import TpuSlice

NAMESPACE = "ml"
APP = {"name": "chat", "import_path": "serving.model:build_app", "version_arg": "model_version"}


class MemoryStore:
    """Objects by (namespace, name), with resourceVersions; a 409 for a stale write or a taken name.

    :param status_writes: how many times "the operator" writes the status between a read and
        the next replace (each makes that replace stale).
    """

    def __init__(self, status_writes: int = 0) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0
        self.status_writes = status_writes
        self.hidden_reads = 0
        self.calls: list[str] = []
        self.before_delete: list[dict[str, Any]] = []  # objects put in place just before a delete (a race)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        stored["metadata"].setdefault("uid", f"uid-{self.version}")
        self.objects[(stored["metadata"]["namespace"], stored["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        self.calls.append("get")
        if self.hidden_reads:  # a read that raced our own create
            self.hidden_reads -= 1
            return None
        found = self.objects.get((namespace, name))
        return copy.deepcopy(found) if found else None

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        if (manifest["metadata"]["namespace"], manifest["metadata"]["name"]) in self.objects:
            raise AlreadyExists(manifest["metadata"]["name"])
        return self.put(manifest)

    def delete(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        self.calls.append("delete")
        while self.before_delete:
            self.objects.pop((namespace, name), None)
            self.put(self.before_delete.pop(0))
        stored = self.objects.get((namespace, name))
        if stored is not None and precondition is not None and (unmet := precondition.unmet(stored)):
            raise ChangedSinceChecked("RayCluster", name, namespace, unmet)
        return self.objects.pop((namespace, name), None) is not None

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("replace")
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        if self.status_writes:
            self.status_writes -= 1
            self.put(self.objects[key])  # KubeRay wrote the status meanwhile
        if manifest["metadata"].get("resourceVersion") != self.objects[key]["metadata"]["resourceVersion"]:
            raise StaleWrite(manifest["metadata"]["name"])
        return self.put(manifest)


def cluster(topology: str = "4x4", run: str = "run-1", dag: str = "nightly", deployment: str = "") -> dict[str, Any]:
    return build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TpuSlice("v6e", topology),
                             origin=AirflowOrigin(dag, run, "create", deployment=deployment))


def service(version: str, run: str = "run-1", task: str = "deploy") -> dict[str, Any]:
    return build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"), applications=[APP],
                             version=version, origin=AirflowOrigin("serving", run, task))


def apply_cluster(store: MemoryStore, manifest: dict[str, Any], on_change: OnChange = OnChange.FAIL,
                  **kwargs: Any) -> Any:
    return apply_object(store, manifest, same=same_spec, owner=CLUSTER_OWNER, on_change=on_change, **kwargs)


def apply_service(store: MemoryStore, manifest: dict[str, Any]) -> Any:
    return apply_object(store, manifest, same=same_service, owner=SERVICE_OWNER, on_change=OnChange.REPLACE)


def test_a_missing_object_is_created() -> None:
    store = MemoryStore()
    result = apply_cluster(store, cluster())
    assert result.action is Applied.CREATED
    assert result.cluster["metadata"]["resourceVersion"] == "1"
    assert store.calls == ["get", "create"]


def test_a_lost_create_answer_is_read_again_and_adopted() -> None:
    store = MemoryStore()
    store.put(cluster())  # our first attempt landed, its answer was lost
    store.hidden_reads = 1  # and the read before the retry raced it
    result = apply_cluster(store, cluster())
    assert result.action is Applied.ADOPTED
    assert store.calls == ["get", "create", "get"]
    assert store.version == 1, "nothing was written"


@pytest.mark.parametrize("manifest", [cluster(), service("v1")], ids=["RayCluster", "RayService"])
def test_a_same_named_object_this_provider_did_not_make_is_a_conflict(manifest: dict[str, Any]) -> None:
    store = MemoryStore()
    foreign = copy.deepcopy(manifest)
    del foreign["metadata"]["labels"][MANAGED_BY_LABEL]
    store.put(foreign)
    with pytest.raises(ConflictError, match="not made by this provider") as info:
        apply_object(store, manifest, same=same_spec, owner=CLUSTER_OWNER, on_change=OnChange.RECREATE)
    assert f"{manifest['kind']} {manifest['metadata']['name']!r} in namespace 'ml'" in str(info.value)
    assert "replace" not in store.calls and store.version == 1


def test_our_own_same_spec_is_adopted_without_a_write() -> None:
    store = MemoryStore()
    store.put(cluster())
    result = apply_cluster(store, cluster(), OnChange.RECREATE)
    assert result.action is Applied.ADOPTED
    assert store.calls == ["get"] and store.version == 1


@pytest.mark.parametrize("other", [cluster(run="run-2"), cluster(dag="nightly.other")], ids=["run", "DAG"])
def test_another_runs_or_dags_cluster_is_never_adopted_or_changed(other: dict[str, Any]) -> None:
    store = MemoryStore()
    store.put(cluster())
    for on_change in OnChange:
        with pytest.raises(ConflictError) as info:
            apply_cluster(store, other, on_change)
        assert "belongs to DAG 'nightly', run 'run-1', task 'create', not to this task" in str(info.value)
        assert "Leave the name unset" in str(info.value)
    assert store.calls == ["get"] * 3 and store.version == 1


def test_the_same_task_in_another_airflow_deployment_never_adopts_or_changes_the_cluster() -> None:
    """Staging and prod with the same DAG ids in one namespace: prod's task never takes staging's cluster; one
    made before the deployment was recorded is refused, with the command that records it."""
    store = MemoryStore()
    store.put(cluster(deployment="staging"))
    for on_change in OnChange:
        with pytest.raises(ConflictError) as info:
            apply_cluster(store, cluster(deployment="prod"), on_change)
        assert ("belongs to DAG 'nightly', run 'run-1', task 'create', deployment 'staging', not to this task "
                "(DAG 'nightly', run 'run-1', task 'create', deployment 'prod')") in str(info.value)
        assert "give each deployment's raytpu connection its own extra.deployment" in str(info.value)
    assert apply_cluster(store, cluster(deployment="staging")).action is Applied.ADOPTED

    legacy = MemoryStore()
    legacy.put(cluster())
    with pytest.raises(ConflictError, match="made before this provider recorded the Airflow deployment. If it is "
                                            "this deployment's, record that: kubectl annotate -n ml rayclusters "
                                            "train raytpu.dev/deployment=prod"):
        apply_cluster(legacy, cluster(deployment="prod"))
    assert legacy.version == 1


def test_a_different_spec_is_a_conflict_naming_its_owner_unless_updating_is_allowed() -> None:
    store = MemoryStore()
    store.put(cluster())
    with pytest.raises(ConflictError, match="update_if_exists=True") as info:
        apply_cluster(store, cluster("4x8"))
    assert "made by DAG 'nightly', run 'run-1', task 'create'" in str(info.value)
    assert store.version == 1


def test_our_own_different_cluster_is_recreated_not_replaced() -> None:
    store = MemoryStore()
    store.put(cluster())
    result = apply_cluster(store, cluster("4x8"), OnChange.RECREATE, poll_interval=0)
    assert result.action is Applied.RECREATED
    assert store.calls == ["get", "delete", "get", "get", "create"], "deleted, waited for until gone, created"
    stored = store.objects[(NAMESPACE, "train")]
    assert stored["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 8
    assert stored["metadata"]["resourceVersion"] == "2"


def test_a_cluster_replaced_between_the_owner_check_and_the_delete_is_checked_again_not_deleted() -> None:
    store = MemoryStore()
    store.put(cluster())
    store.before_delete.append(cluster(run="run-2"))  # another run's same-named cluster, made in the window
    with pytest.raises(ConflictError, match="belongs to DAG 'nightly', run 'run-2'"):
        apply_cluster(store, cluster("4x8"), OnChange.RECREATE, poll_interval=0)
    assert store.calls == ["get", "delete", "get"], "the refused delete was not retried: the new one was checked"
    assert store.objects[(NAMESPACE, "train")]["metadata"]["annotations"]["raytpu.dev/run-id"] == "run-2"


def test_a_manifest_made_from_a_stored_object_changes_only_that_object() -> None:
    store = MemoryStore()
    read = store.put(service("v1"))
    made_from_it = service("v2")
    made_from_it["metadata"]["uid"] = read["metadata"]["uid"]
    store.objects.clear()
    store.put(service("v1"))  # deleted and deployed again since it was read: a new uid
    with pytest.raises(ChangedSinceChecked, match="RayService ml/chat changed since it was checked: not changed"):
        apply_service(store, made_from_it)
    store.objects.clear()
    with pytest.raises(ChangedSinceChecked):  # gone since it was read: not created again either
        apply_service(store, made_from_it)
    assert "replace" not in store.calls and "create" not in store.calls


def test_an_object_being_deleted_is_waited_for_then_created() -> None:
    store = MemoryStore()
    dying = copy.deepcopy(cluster())
    dying["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    store.put(dying)
    gets = iter([True, True, False])  # two reads still find it; then the finalizers are done

    def get(name: str, namespace: str) -> dict[str, Any] | None:
        found = MemoryStore.get(store, name, namespace)
        if found is not None and not next(gets):
            store.objects.clear()
            return None
        return found

    store.get = get  # type: ignore[method-assign]
    result = apply_cluster(store, cluster(), poll_interval=0)
    assert result.action is Applied.CREATED and "deletionTimestamp" not in result.cluster["metadata"]


def test_a_different_service_is_replaced_keeping_the_stored_metadata() -> None:
    store = MemoryStore()
    first = copy.deepcopy(service("v1"))
    first["metadata"]["labels"]["team"] = "research"  # set by someone else: kept
    store.put(first)
    result = apply_service(store, service("v2", run="run-2"))
    assert result.action is Applied.UPDATED
    stored = store.objects[(NAMESPACE, "chat")]
    assert service_version(stored) == "v2"
    assert stored["metadata"]["uid"] == "uid-1" and stored["metadata"]["labels"]["team"] == "research"
    assert stored["metadata"]["annotations"] == {**first["metadata"]["annotations"],
                                                 **service("v2", run="run-2")["metadata"]["annotations"]}


def test_a_service_belongs_to_its_dag_and_task_not_to_a_run() -> None:
    store = MemoryStore()
    apply_service(store, service("v1"))
    assert apply_service(store, service("v1", run="run-2")).action is Applied.ADOPTED
    promoted = apply_service(store, service("v2", run="run-3"))
    assert promoted.action is Applied.UPDATED and service_version(promoted.cluster) == "v2"
    with pytest.raises(ConflictError, match="belongs to DAG 'serving', run 'run-3', task 'deploy'"):
        apply_service(store, service("v3", task="deploy_canary"))


def test_a_stale_write_is_read_again_and_retried() -> None:
    store = MemoryStore(status_writes=1)
    store.put(service("v1"))
    result = apply_service(store, service("v2"))
    assert result.action is Applied.UPDATED
    assert store.calls == ["get", "replace", "get", "replace"]


def test_an_object_that_keeps_changing_fails_after_a_bounded_number_of_attempts() -> None:
    store = MemoryStore(status_writes=100)
    store.put(service("v1"))
    with pytest.raises(FatalError, match=r"RayService ml/chat kept changing while being applied \(3 attempts\)"):
        apply_object(store, service("v2"), same=same_service, owner=SERVICE_OWNER, on_change=OnChange.REPLACE,
                     attempts=3)
    assert store.calls.count("replace") == 3
