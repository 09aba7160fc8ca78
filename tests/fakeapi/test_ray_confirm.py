"""RayClusterReadyTrigger with ``confirm_with_ray``: READY waits for Ray's node list, read through the API
server's service proxy; pods GKE's TPU webhook did not mutate fail at once.

The fake KubeRay makes the pods (with the webhook's variables when ``tpu_webhook``); Ray's State API is
stood in for by :class:`tests.support.ray_state_stub.RayStateStub`, which lists what Ray registers for those
pods. The same checks against real raylets run in tests/controlplane/test_ray_confirm.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.support.fake_apiserver.kuberay import KubeRayReactor
from tests.support.fake_apiserver.server import FakeKubeApiServer
from tests.support.kube_connection import NAMESPACE
from tests.support.ray_state_stub import RayStateStub, ray_node

pytestmark = pytest.mark.timeout(60)

TPU = TpuSlice("v6e", "4x4", num_slices=2)


@pytest.fixture
def ray(kube: FakeKubeApiServer) -> Iterator[RayStateStub]:
    with RayStateStub(kube, NAMESPACE, TPU.pod_type) as stub:
        kube.register_service_proxy(NAMESPACE, "train-head-svc", "dashboard", stub.url_for("train"))
        yield stub


def confirming(deadline_in: float = 30.0, grace_period: float = 600) -> RayClusterReadyTrigger:
    return RayClusterReadyTrigger("train", NAMESPACE, "raytpu_default", time.time() + deadline_in, 0.3,
                                  grace_period, confirm_with_ray=True)


async def first_event(t: RayClusterReadyTrigger) -> dict[str, Any]:
    async for event in t.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def worker_pods(kube: FakeKubeApiServer) -> list[dict[str, Any]]:
    return [p for p in kube.list_objects("pods", NAMESPACE, label_selector="ray.io/node-type=worker")
            if (p.get("status") or {}).get("phase") == "Running"]


async def test_ready_waits_until_ray_lists_every_host(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                      ray: RayStateStub) -> None:
    with KubeRayReactor(kube, delay=0.1, stagger=0.01, tpu_webhook=True):
        backend.apply_cluster(build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TPU))
        await asyncio.to_thread(kube.wait_for, lambda: len(worker_pods(kube)) == 8, 20)
        late = sorted(p["metadata"]["name"] for p in worker_pods(kube))[-1]
        ray.hide(late)  # its raylet has not registered yet
        task = asyncio.create_task(first_event(confirming()))
        await asyncio.to_thread(kube.wait_for, lambda: ray.requests["train"] >= 2, 20)
        assert not task.done(), "ready pods are not READY while Ray does not list one of the hosts"
        # Ray also lists the raylets of hosts that died earlier (a preempted slice's), as DEAD.
        earlier = worker_pods(kube)[:4]
        ray.dead = [{**ray_node(pod, TPU.pod_type), "node_ip": f"10.9.0.{i}"} for i, pod in enumerate(earlier)]
        ray.hide()
        event = await task
    assert event["status"] == "READY", event
    assert (event["cluster"]["ready_hosts"], event["cluster"]["ray_hosts"]) == (8, 8)
    assert event["cluster"]["message"].endswith("Ray lists 8 of 8 TPU hosts with their chips and slice, "
                                                "one slice head per slice")


async def test_a_host_ray_never_lists_fails_after_the_grace_period_naming_it(
        backend: KubeRayBackend, kube: FakeKubeApiServer, ray: RayStateStub) -> None:
    with KubeRayReactor(kube, delay=0.1, stagger=0.01, tpu_webhook=True):
        backend.apply_cluster(build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TPU))
        await asyncio.to_thread(kube.wait_for, lambda: len(worker_pods(kube)) == 8, 20)
        late = next(p for p in worker_pods(kube) if p["metadata"]["labels"]["ray.io/replica-host-index"] == "2")
        ray.hide(late["metadata"]["name"])
        event = await first_event(confirming(grace_period=2))
    assert event["status"] == "FAILED", event
    message = event["cluster"]["message"]
    assert message.startswith("Ray has not listed its TPU hosts for ")
    slice_index = late["metadata"]["labels"]["ray.io/worker-group-replica-index"]
    assert f"Ray does not list 1 TPU host: pod {late['metadata']['name']} (slice {slice_index})" in message


async def test_pods_the_tpu_webhook_did_not_mutate_fail_at_once(backend: KubeRayBackend, kube: FakeKubeApiServer,
                                                                ray: RayStateStub) -> None:
    with KubeRayReactor(kube, delay=0.1, stagger=0.01, tpu_webhook=False):
        backend.apply_cluster(build_ray_cluster(name="train", namespace=NAMESPACE, tpu=TPU))
        started = time.monotonic()
        event = await first_event(confirming(deadline_in=30))
    assert time.monotonic() - started < 20, "not the deadline"
    assert event["status"] == "FAILED" and event["cluster"]["reason"] == "TpuWebhookMissing", event
    assert event["cluster"]["message"].startswith("the GKE TPU webhook did not mutate these pods: slice 0 (pod train-")
    assert ray.requests["train"] == 0, "no need to ask Ray about pods that cannot form a slice"
