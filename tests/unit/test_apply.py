"""The one apply path (backends/apply.py) over an in-memory store that answers as the API server does.

The store keeps resourceVersions and refuses a stale replace (409) or a second create of a
name (409), so every branch runs against real manifests from the builders: create, a lost
create answer, a foreign object, the same spec, a different spec with and without update,
a stale write read again, and an object that keeps changing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from airflow_provider_raytpu.backends.apply import AlreadyExists, StaleWrite, apply_object, same_service, same_spec
from airflow_provider_raytpu.backends.base import Applied
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

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        stored["metadata"].setdefault("uid", f"uid-{stored['metadata']['name']}")
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

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("replace")
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        if self.status_writes:
            self.status_writes -= 1
            self.put(self.objects[key])  # KubeRay wrote the status meanwhile
        if manifest["metadata"].get("resourceVersion") != self.objects[key]["metadata"]["resourceVersion"]:
            raise StaleWrite(manifest["metadata"]["name"])
        return self.put(manifest)


def cluster(topology: str = "4x4", run: str = "run-1") -> dict[str, Any]:
    return build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TpuSlice("v6e", topology),
                             origin=AirflowOrigin("nightly", run, "create"))


def service(version: str) -> dict[str, Any]:
    return build_ray_service(name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2"), applications=[APP],
                             version=version)


def test_a_missing_object_is_created() -> None:
    store = MemoryStore()
    result = apply_object(store, cluster(), same=same_spec, update=False)
    assert result.action is Applied.CREATED
    assert result.cluster["metadata"]["resourceVersion"] == "1"
    assert store.calls == ["get", "create"]


def test_a_lost_create_answer_is_read_again_and_adopted() -> None:
    store = MemoryStore()
    store.put(cluster())  # our first attempt landed, its answer was lost
    store.hidden_reads = 1  # and the read before the retry raced it
    result = apply_object(store, cluster(), same=same_spec, update=False)
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
        apply_object(store, manifest, same=same_spec, update=True)
    assert f"{manifest['kind']} {manifest['metadata']['name']!r} in namespace 'ml'" in str(info.value)
    assert "replace" not in store.calls and store.version == 1


def test_the_same_spec_is_adopted_without_a_write() -> None:
    store = MemoryStore()
    store.put(cluster())
    result = apply_object(store, cluster(run="run-2"), same=same_spec, update=True)
    assert result.action is Applied.ADOPTED
    assert store.calls == ["get"] and store.version == 1


def test_a_different_spec_is_a_conflict_naming_its_owner_unless_updating_is_allowed() -> None:
    store = MemoryStore()
    store.put(cluster())
    with pytest.raises(ConflictError, match="update_if_exists=True") as info:
        apply_object(store, cluster("4x8"), same=same_spec, update=False)
    assert "made by DAG 'nightly', run 'run-1', task 'create'" in str(info.value)
    assert store.version == 1


def test_a_different_spec_is_replaced_keeping_the_stored_metadata() -> None:
    store = MemoryStore()
    first = copy.deepcopy(cluster())
    first["metadata"]["labels"]["team"] = "research"  # set by someone else: kept
    store.put(first)
    result = apply_object(store, cluster("4x8", run="run-2"), same=same_spec, update=True)
    assert result.action is Applied.UPDATED
    stored = store.objects[(NAMESPACE, "train")]
    assert stored["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 8
    assert stored["metadata"]["uid"] == "uid-train" and stored["metadata"]["labels"]["team"] == "research"
    assert stored["metadata"]["annotations"] == {**first["metadata"]["annotations"],
                                                 **cluster("4x8", run="run-2")["metadata"]["annotations"]}


def test_a_new_model_version_is_an_update_and_the_same_one_is_adopted() -> None:
    store = MemoryStore()
    apply_object(store, service("v1"), same=same_service, update=True)
    assert apply_object(store, service("v1"), same=same_service, update=True).action is Applied.ADOPTED
    promoted = apply_object(store, service("v2"), same=same_service, update=True)
    assert promoted.action is Applied.UPDATED and service_version(promoted.cluster) == "v2"


def test_a_stale_write_is_read_again_and_retried() -> None:
    store = MemoryStore(status_writes=1)
    store.put(cluster())
    result = apply_object(store, cluster("4x8"), same=same_spec, update=True)
    assert result.action is Applied.UPDATED
    assert store.calls == ["get", "replace", "get", "replace"]


def test_an_object_that_keeps_changing_fails_after_a_bounded_number_of_attempts() -> None:
    store = MemoryStore(status_writes=100)
    store.put(cluster())
    with pytest.raises(FatalError, match=r"RayCluster ml/train kept changing while being applied \(3 attempts\)"):
        apply_object(store, cluster("4x8"), same=same_spec, update=True, attempts=3)
    assert store.calls.count("replace") == 3
