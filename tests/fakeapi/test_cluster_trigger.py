"""RayClusterReadyTrigger against a Kubernetes API over HTTP: it watches, resumes, re-lists, diagnoses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.backends.kuberay import informer as kuberay_informer
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.support.fake_apiserver.kuberay import KubeRayReactor, replica_failure
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

pytestmark = pytest.mark.timeout(60)


def trigger(deadline_in: float = 30.0, poll_interval: float = 0.5, grace_period: float = 600) -> RayClusterReadyTrigger:
    return RayClusterReadyTrigger("train", NAMESPACE, "raytpu_default", time.time() + deadline_in, poll_interval,
                                  grace_period)


async def first_event(t: RayClusterReadyTrigger) -> dict[str, Any]:
    async for event in t.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def create(backend: KubeRayBackend) -> None:
    backend.apply_cluster(build_ray_cluster(name="train", namespace=NAMESPACE,
                                            tpu=TpuSlice("v6e", "4x4", num_slices=2)))


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


STALLED_GET = r"/rayclusters/train$"
EMPTY_LIST = {"apiVersion": "ray.io/v1", "kind": "RayClusterList", "items": [], "metadata": {"resourceVersion": "1"}}


async def test_an_api_call_that_times_out_is_not_the_wait_deadline(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """The informer's first GET of the cluster times out (on all 6 attempts of the API client's own retry): a
    transient error, tried again by the trigger, not the sensor's timeout."""
    from airflow_provider_raytpu.backends.kuberay import watch

    create(backend)
    await asyncio.to_thread(kube.wait_for, lambda: (kube.get_object("rayclusters", NAMESPACE, "train") or {}).get(
        "status", {}).get("state") == "ready")
    monkeypatch.setattr(watch, "GET_TIMEOUT_SECONDS", 1.0)
    kube.inject("GET", r"/rayclusters$", 200, body=EMPTY_LIST, watch=False)  # the list misses it: one GET
    kube.stall("GET", STALLED_GET, 3.0, times=6)  # longer than each GET may take, for all its 6 attempts
    event = await first_event(trigger(deadline_in=40))
    assert event["status"] == "READY", event
    assert ("RayCluster ml/train: the Kubernetes API unreachable for 0 s (TimeoutError); trying for up to 600 s "
            "more") in capfd.readouterr().out


async def test_an_api_unreachable_for_longer_than_its_grace_is_a_retryable_event(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

    from airflow_provider_raytpu.backends.kuberay import watch
    from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

    create(backend)
    monkeypatch.setattr(watch, "GET_TIMEOUT_SECONDS", 0.5)
    kube.inject("GET", r"/rayclusters$", 200, body=EMPTY_LIST, watch=False, times=None)
    kube.stall("GET", STALLED_GET, 2.0, times=None)
    waiting = RayClusterReadyTrigger("train", NAMESPACE, "raytpu_default", time.time() + 30, 0.5,
                                     unreachable_grace_period=3)
    event = await first_event(waiting)
    assert event["status"] == "UNREACHABLE"
    assert ("the Kubernetes API unreachable for" in event["message"]
            and "longer than its grace of 3 s" in event["message"])
    sensor = RayClusterReadySensor(task_id="wait_ready", cluster_name="train")
    with pytest.raises(AirflowException) as raised:
        sensor.execute_complete({}, event)
    assert not isinstance(raised.value, (AirflowSensorTimeout, AirflowFailException)), "a retry may find it back"
