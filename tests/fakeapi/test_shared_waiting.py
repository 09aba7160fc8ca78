"""Many RayCluster triggers on one event loop (as in the triggerer): one client, one list+watch, closed after them.

Connections are counted on the fake API server's side (TCP connections accepted), requests in
its request log.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.backends.kuberay.clients import shared_api_client
from airflow_provider_raytpu.loop_shared import close_loop_shared
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE

pytestmark = pytest.mark.timeout(60)

CLUSTERS = r"/rayclusters$"


async def first_event(name: str) -> dict[str, Any]:
    async for event in RayClusterReadyTrigger(name, NAMESPACE, "raytpu_default", time.time() + 30, 0.5).run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def create(backend: KubeRayBackend, *names: str) -> None:
    for name in names:
        backend.apply_cluster(build_ray_cluster(name=name, namespace=NAMESPACE, tpu=TpuSlice("v6e", "2x2")))


async def waiting(kube: FakeKubeApiServer, names: list[str]) -> list[asyncio.Task[dict[str, Any]]]:
    """Triggers for ``names``, once the informer's watch is open and every trigger has its first status."""
    tasks = [asyncio.create_task(first_event(name)) for name in names]
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1, 10)
    await asyncio.sleep(0.2)
    return tasks


def lists(kube: FakeKubeApiServer) -> int:
    return kube.count("GET", CLUSTERS, watch=False)


def watches(kube: FakeKubeApiServer) -> list[Any]:
    return [r for r in kube.requests if r.watch and r.path.endswith("/rayclusters")]


async def test_triggers_share_one_client_and_one_watch_and_close_them(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    names = [f"rc-{i}" for i in range(6)]
    create(backend, *names)
    idle, opened = kube.open_connections, kube.connections_opened  # the sync client's pool
    tasks = await waiting(kube, names)
    assert (lists(kube), len(watches(kube))) == (1, 1)
    assert kube.connections_opened - opened <= 2, "one connection for the watch, one for the rest"
    kuberay.set_mode("auto")
    events = await asyncio.gather(*tasks)
    assert [e["status"] for e in events] == ["READY"] * 6
    assert kube.count("GET", r"/pods$") < 6, "pods of clusters that turned ready together are read together"
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 0, 10)  # the last one left: watch stopped
    await close_loop_shared()
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_connections == idle, 10)
    assert kube.connections_opened - opened <= 3


async def test_a_cut_stream_resumes_for_every_subscriber_without_a_missed_event(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    names = ["a", "b", "c"]
    create(backend, *names)
    tasks = await waiting(kube, names)
    kube.reset_connection("GET", CLUSTERS, times=1, watch=True)  # the first attempt to resume fails too
    kube.cut_watches()
    kuberay.set_mode("auto")  # the clusters turn ready while the stream is down
    events = await asyncio.gather(*tasks)
    assert [e["status"] for e in events] == ["READY"] * 3
    assert lists(kube) == 1, "resumed from the last resourceVersion, not listed again"
    assert all(int(w.query["resourceVersion"]) > 0 for w in watches(kube)[1:])


async def test_410_gone_means_one_list_again(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                             kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    names = ["a", "b", "c"]
    create(backend, *names)
    tasks = await waiting(kube, names)
    kube.inject("GET", CLUSTERS, 410, times=1, watch=True)  # the version it resumes from is too old
    kube.cut_watches()
    await asyncio.to_thread(kube.wait_for, lambda: lists(kube) == 2 and kube.open_watches == 1, 10)
    kuberay.set_mode("auto")
    events = await asyncio.gather(*tasks)
    assert [e["status"] for e in events] == ["READY"] * 3
    assert lists(kube) == 2


async def test_a_subscriber_leaving_does_not_disturb_the_others(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                                kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    names = ["a", "b", "c"]
    create(backend, *names)
    tasks = await waiting(kube, names)
    tasks[0].cancel()  # a task marked failed: its trigger is cancelled
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert kube.open_watches == 1
    kuberay.set_mode("auto")
    events = await asyncio.gather(*tasks[1:])
    assert [e["status"] for e in events] == ["READY"] * 2
    assert (lists(kube), len(watches(kube))) == (1, 1)


async def test_a_cluster_that_does_not_exist_is_gone_and_a_new_one_is_not(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor) -> None:
    kuberay.set_mode("hold")
    create(backend, "a")
    tasks = await waiting(kube, ["a"])
    assert (await first_event("nothing"))["status"] == "GONE"
    create(backend, "fresh")  # made after the informer listed; its sensor defers at once
    fresh = asyncio.create_task(first_event("fresh"))
    await asyncio.sleep(0.5)
    assert not fresh.done()
    kuberay.set_mode("auto")
    assert [e["status"] for e in await asyncio.gather(*tasks, fresh)] == ["READY", "READY"]


async def test_rejected_credentials_replace_the_client(
        backend: KubeRayBackend, kube: FakeKubeApiServer, kuberay: KubeRayReactor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    kuberay.set_mode("hold")
    create(backend, "a")
    tasks = await waiting(kube, ["a"])
    shared = await shared_api_client(backend.settings)
    assert shared.clients_made == 1
    kube.rotate_token()  # the old token expires; the connection now holds the new one
    monkeypatch.setenv("AIRFLOW_CONN_KUBE_TEST", kube.airflow_connection(NAMESPACE))
    kube.cut_watches()
    await asyncio.to_thread(kube.wait_for, lambda: kube.open_watches == 1, 10)
    kuberay.set_mode("auto")
    assert (await tasks[0])["status"] == "READY"
    assert shared.clients_made == 2
    assert kube.count("GET", CLUSTERS, watch=True) >= 3  # watched, refused (401), watched with the new client
