"""A preempted TPU host, end to end: the real KubeRay operator recreates the whole slice,
the provider reports that slice not ready until its pods run again, then READY."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import (
    NODEPOOL_LABEL,
    REPLICA_INDEX,
    NodePools,
    lifecycle_dag,
    pod_ready,
    ready_delete_dag,
    states,
    wait_for,
    wait_no_pods,
)
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420)]

V4 = "tpu-v4-podslice"
CLUSTER = "preemptible"


def workers(backend: Any, namespace: str) -> list[dict[str, Any]]:
    return [p for p in backend.cluster_pods(CLUSTER, namespace)
            if p["metadata"]["labels"].get("ray.io/node-type") == "worker"
            and not p["metadata"].get("deletionTimestamp")]


async def first_event(trigger: RayClusterReadyTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


@pytest.mark.usefixtures("admin_connections")
def test_preempted_host_recreates_its_slice_which_is_not_ready_until_replaced(
        airflow_home: Path, k8s_control_plane: ControlPlane, head_nodes: list[str], node_pools: NodePools,
        namespace: str) -> None:
    # Two v4 2x2x2 slices (2 hosts of 4 chips each) on exactly four nodes of one pool.
    pool = node_pools.add("v4", tpu=V4, topology="2x2x2", num_nodes=4).name
    _preemption(airflow_home, k8s_control_plane, namespace, pool)


def _preemption(airflow_home: Path, cp: ControlPlane, ns: str, pool: str) -> None:
    create = {"cluster_name": CLUSTER, "accelerator": "v4", "topology": "2x2x2", "num_slices": 2,
              # A user fragment: pin the hosts to this pool (other tests' TPU nodes stay out of it).
              "worker_pod_template": {"spec": {"nodeSelector": {NODEPOOL_LABEL: pool}}}}
    outcome = run_dag(airflow_home, lifecycle_dag("k8s_preempt_create", create=create, delete=False),
                      "k8s_preempt_create")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success"}, outcome

    backend = RayTpuHook().backend
    assert backend.cluster_status(CLUSTER, ns).phase is Phase.READY
    before = workers(backend, ns)
    assert len(before) == 4 and all(pod_ready(p) for p in before)
    by_slice: dict[str, list[dict[str, Any]]] = {}
    for p in before:
        by_slice.setdefault(p["metadata"]["labels"][REPLICA_INDEX], []).append(p)
    assert sorted(by_slice) == ["0", "1"] and all(len(v) == 2 for v in by_slice.values())
    hit, spared = by_slice["1"], by_slice["0"]
    victim = hit[0]["spec"]["nodeName"]
    old_names = {p["metadata"]["name"] for p in before}
    spared_names = {p["metadata"]["name"] for p in spared}

    cp.delete_node(victim)  # a GKE preemption: the node goes, its pod fails

    def slice_recreated() -> list[dict[str, Any]] | None:
        pods = workers(backend, ns)
        fresh = [p for p in pods if p["metadata"]["name"] not in old_names]
        running = [p for p in fresh if pod_ready(p)]
        pending = [p for p in fresh
                   if (p.get("status") or {}).get("phase") == "Pending" and not p["spec"].get("nodeName")]
        ok = len(pods) == 4 and len(fresh) == 2 and len(running) == 1 and len(pending) == 1
        return pods if ok else None

    pods = wait_for(slice_recreated, 90, "the hit slice recreated whole: 1 host running, 1 pending (no node)")
    # Only the hit slice was recreated; the other slice's pods are untouched and ready.
    survivors = [p for p in pods if p["metadata"]["name"] in old_names]
    assert {p["metadata"]["name"] for p in survivors} == spared_names and all(pod_ready(p) for p in survivors)
    fresh = [p for p in pods if p["metadata"]["name"] not in old_names]
    (fresh_index,) = {p["metadata"]["labels"][REPLICA_INDEX] for p in fresh}
    assert all(p["spec"].get("nodeName") != victim for p in fresh)

    # The provider: not ready, and exactly which slice is short.
    for _ in range(3):
        status = backend.cluster_status(CLUSTER, ns)
        assert status.phase is Phase.PROVISIONING, status
        assert {s.index: (s.ready_hosts, s.hosts) for s in status.slices} == {"0": (2, 2), fresh_index: (1, 2)}
        assert f"slice {fresh_index}: 1/2" in status.message
        time.sleep(0.3)
    # The trigger (the deferred sensor's wait) does not fire READY either: at its deadline it
    # reports the pending host and the scheduler's reason.
    event = asyncio.run(first_event(RayClusterReadyTrigger(CLUSTER, ns, "raytpu_default", time.time() + 3, 1)))
    assert event["status"] == "TIMEOUT", event
    pending = next(p for p in fresh if not pod_ready(p))["metadata"]["name"]
    assert f"slice {fresh_index} host" in event["diagnosis"] and f"(pod {pending}): Unschedulable" in event["diagnosis"]

    # A replacement node joins the pool: the slice runs again, the sensor says READY, delete cleans up.
    replacement = cp.add_node_pool(pool, tpu=V4, topology="2x2x2", num_nodes=1)
    outcome = run_dag(airflow_home, ready_delete_dag("k8s_preempt_finish", CLUSTER), "k8s_preempt_finish")
    assert states(outcome) == {"wait_ready": "success", "delete_cluster": "success"}, outcome
    ready = outcome["wait_ready"].result
    assert ready["phase"] == "READY" and ready["ready_hosts"] == 4
    assert sorted((s["index"], s["ready_hosts"], s["hosts"]) for s in ready["slices"]) == sorted(
        [("0", 2, 2), (fresh_index, 2, 2)])
    assert replacement and victim not in replacement
    wait_no_pods(cp, ns)
