"""RayClusterReadyTrigger against a Kubernetes API over HTTP: it watches, resumes, re-lists, diagnoses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay import informer as kuberay_informer
from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.fakekube.kuberay import KubeRayReactor, replica_failure
from tests.fakekube.server import FakeKubeApiServer
from tests.kube.conftest import NAMESPACE

pytestmark = pytest.mark.timeout(60)


def trigger(deadline_in: float = 30.0, poll_interval: float = 0.5, grace_period: float = 600) -> RayClusterReadyTrigger:
    return RayClusterReadyTrigger("train", NAMESPACE, "raytpu_default", time.time() + deadline_in, poll_interval,
                                  grace_period)


async def first_event(t: RayClusterReadyTrigger) -> dict[str, Any]:
    async for event in t.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def create(backend: KubeRayBackend) -> None:
    backend.apply_cluster(build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4", num_slices=2)))


def test_serialization_round_trips() -> None:
    t = trigger()
    path, kwargs = t.serialize()
    assert path == "airflow_provider_raytpu.triggers.raycluster.RayClusterReadyTrigger"
    assert RayClusterReadyTrigger(**kwargs).serialize() == (path, kwargs)


async def test_fires_ready_from_a_watch(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                        kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger()))
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    kuberay.set_mode("auto")
    event = await task
    assert event["status"] == "READY"
    assert event["cluster"]["ready_hosts"] == 8
    lists = [r for r in kube.requests if r.method == "GET" and r.path.endswith("/rayclusters") and not r.watch]
    watches = [r for r in kube.requests if r.path.endswith("/rayclusters") and r.watch]
    assert len(lists) == 1 and len(watches) == 1
    assert watches[0].query["allowWatchBookmarks"] == "true" and "fieldSelector" not in watches[0].query


async def test_resumes_after_a_cut_stream(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                          kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger()))
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    kube.cut_watches()
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    kuberay.set_mode("auto")
    assert (await task)["status"] == "READY"
    watches = [r for r in kube.requests if r.path.endswith("/rayclusters") and r.watch]
    assert len(watches) == 2 and watches[1].query["resourceVersion"] >= watches[0].query["resourceVersion"]


async def test_lists_again_after_410_gone(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                          kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger()))
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    kuberay.set_mode("auto")
    kube.compact()
    kube.cut_watches()
    assert (await task)["status"] == "READY"


async def test_polls_when_watching_keeps_failing(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                 kuberay: KubeRayReactor) -> None:
    kube.inject("GET", r"/rayclusters$", 500, times=None, watch=True)
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger(poll_interval=0.2)))
    await asyncio.to_thread(kube.wait_for, lambda: kube.count("GET", r"/rayclusters$", watch=True) >= 3)
    kuberay.set_mode("auto")
    assert (await task)["status"] == "READY"
    assert kube.count("GET", r"/rayclusters$", watch=False) >= 2


async def test_watches_again_after_a_spell_of_polling(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                     kuberay: KubeRayReactor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kuberay_informer, "POLL_BEFORE_WATCHING_AGAIN_SECONDS", 1.0)
    kube.inject("GET", r"/rayclusters$", 500, times=3, watch=True)
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger(poll_interval=0.2)))
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    assert kube.count("GET", r"/rayclusters$", watch=False) >= 3  # it polled between the failures and the new watch
    kuberay.set_mode("auto")
    assert (await task)["status"] == "READY"


async def test_a_replica_failure_that_clears_is_waited_out(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                            kuberay: KubeRayReactor) -> None:
    kuberay.set_mode(replica_failure(message="pods \"w\" is forbidden: exceeded quota: tpu-quota"))
    create(backend)
    task = asyncio.create_task(first_event(trigger()))
    await asyncio.to_thread(kube.wait_for, lambda: any(
        c["type"] == "ReplicaFailure" for c in (kube.get_object("rayclusters", NAMESPACE, "train").get("status") or {})
        .get("conditions", [])) and kube.open_watches == 1)
    assert not task.done(), "a reconcile failure is progress, not the end of the wait"
    kuberay.set_mode("auto")  # the quota was raised: the next reconcile creates the pods
    assert (await task)["status"] == "READY"


async def test_a_replica_failure_fails_once_it_outlasts_the_grace_period(backend: KubeRayBackend,
                                                                       kuberay: KubeRayReactor) -> None:
    kuberay.set_mode(replica_failure(message="pods \"w\" is forbidden: exceeded quota: tpu-quota"))
    create(backend)
    event = await first_event(trigger(grace_period=1))
    assert event["status"] == "FAILED"
    assert "longer than the grace period of 1 s" in event["cluster"]["message"]
    assert "FailedCreateWorkerPod: pods \"w\" is forbidden: exceeded quota" in event["cluster"]["message"]


async def test_fires_gone_when_deleted(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                       kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    create(backend)
    task = asyncio.create_task(first_event(trigger()))
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1)
    await asyncio.to_thread(backend.delete_cluster, "train", NAMESPACE)
    assert (await task)["status"] == "GONE"


async def test_missing_connection_is_an_error_event() -> None:
    t = RayClusterReadyTrigger("train", NAMESPACE, "no_such_conn", time.time() + 5)
    event = await first_event(t)
    assert event["status"] == "ERROR" and "No Airflow connection 'no_such_conn'" in event["message"]
