"""The fake KubeRay operator (``KubeRayReactor``): multi-host clusters made ready, modes, slice loss,
replica failure, deletion, and the RayService status writer, seen through the official clients."""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import watch as awatch

from tests.support.fake_apiserver.kuberay import FINALIZER, KubeRayReactor, auto, hold, replica_failure, unschedulable
from tests.support.fake_apiserver.manifests import NS, G, V, raycluster

pytestmark = pytest.mark.timeout(30)


def _status(server, name):
    return (server.get_object("rayclusters", NS, name) or {}).get("status") or {}


def test_reactor_makes_multi_host_cluster_ready(server, custom, core, reactor):
    progress: list[int] = []
    unsubscribe = server.on_change(lambda ev: ev.plural == "rayclusters" and progress.append(
        (ev.object.get("status") or {}).get("readyWorkerReplicas", 0)))
    custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("tpu", replicas=2, hosts=4))
    rc = reactor.wait_ready("tpu")
    unsubscribe()
    st = rc["status"]
    assert st["state"] == "ready"
    assert (st["desiredWorkerReplicas"], st["readyWorkerReplicas"], st["availableWorkerReplicas"]) == (8, 8, 8)
    assert "minWorkerReplicas" not in st and st["maxWorkerReplicas"] == 8  # int32 omitempty: 0 is absent
    assert st["observedGeneration"] == 1 and st["desiredTPU"] == "32" and st["desiredCPU"] == "66"
    assert st["desiredMemory"] == "8Gi" and st["desiredGPU"] == "0"
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["HeadPodReady"]["status"] == "True" and conds["HeadPodReady"]["reason"] == "HeadPodRunningAndReady"
    assert conds["RayClusterProvisioned"]["reason"] == "AllPodRunningAndReadyFirstTime"
    assert st["head"]["serviceName"] == "tpu-head-svc" and st["head"]["podName"].startswith("tpu-head-")
    assert st["endpoints"]["dashboard"] == "8265"
    assert any(0 < n < 8 for n in progress), progress  # readiness was observable host by host

    pods = core.list_namespaced_pod(NS, label_selector="ray.io/cluster=tpu").items
    assert len(pods) == 9 and all(p.status.phase == "Running" and p.spec.node_name for p in pods)
    head = core.list_namespaced_pod(NS, label_selector="ray.io/cluster=tpu,ray.io/node-type=head").items
    assert len(head) == 1 and head[0].metadata.labels["ray.io/group"] == "headgroup"
    workers = core.list_namespaced_pod(NS, label_selector="ray.io/node-type=worker,ray.io/group=tpu-v6e-4x4").items
    assert len(workers) == 8
    by_replica: dict[str, set] = {}
    for w in workers:
        lb = w.metadata.labels
        assert lb["team"] == "ml" and lb["ray.io/worker-group-replica-name"].startswith("tpu-v6e-4x4-")
        by_replica.setdefault(lb["ray.io/worker-group-replica-index"], set()).add(lb["ray.io/replica-host-index"])
        assert w.spec.node_selector["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert w.spec.tolerations[0].key == "google.com/tpu"
        assert w.spec.containers[0].resources.limits == {"google.com/tpu": "4"}
        assert (w.metadata.owner_references[0].kind == "RayCluster"
                and w.metadata.owner_references[0].uid == rc["metadata"]["uid"])
    assert by_replica == {"0": {"0", "1", "2", "3"}, "1": {"0", "1", "2", "3"}}
    svc = core.read_namespaced_service("tpu-head-svc", NS)
    assert {p.name: p.port for p in svc.spec.ports}["dashboard"] == 8265

    # scale down to one slice: the highest replica index goes
    custom.patch_namespaced_custom_object(
        G, V, NS, "rayclusters", "tpu",
        {"spec": {"workerGroupSpecs": [dict(raycluster("tpu")["spec"]["workerGroupSpecs"][0], replicas=1)]}})
    server.wait_for(lambda: _status(server, "tpu").get("readyWorkerReplicas") == 4 and
                    len(reactor.pods("tpu", labels={"ray.io/node-type": "worker"})) == 4)
    assert {p["metadata"]["labels"]["ray.io/worker-group-replica-index"]
            for p in reactor.pods("tpu", labels={"ray.io/node-type": "worker"})} == {"0"}
    assert _status(server, "tpu")["observedGeneration"] == 2


def test_reactor_hold_unschedulable_then_auto(server, core, reactor):
    reactor.set_mode(hold(), cluster="stuck")
    server.create_object(raycluster("stuck", replicas=1, hosts=2))
    server.wait_for(lambda: len(reactor.pods("stuck")) == 3 and _status(server, "stuck").get("conditions"))
    time.sleep(0.3)  # well past the auto delay
    st = _status(server, "stuck")
    assert "state" not in st and "readyWorkerReplicas" not in st and st["desiredWorkerReplicas"] == 2
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["HeadPodReady"]["status"] == "False"
    assert conds["RayClusterProvisioned"]["reason"] == "RayClusterPodsProvisioning"

    reactor.set_mode(unschedulable(), cluster="stuck")
    server.wait_for(lambda: len(core.list_namespaced_event(NS, field_selector="reason=FailedScheduling").items) == 3)
    ev = core.list_namespaced_event(NS, field_selector="reason=FailedScheduling").items[0]
    assert ev.type == "Warning" and ev.message.startswith(
        "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.")
    assert ev.involved_object.kind == "Pod" and ev.reporting_component == "default-scheduler"
    p = core.read_namespaced_pod(ev.involved_object.name, NS)
    assert p.status.phase == "Pending"
    assert [(c.type, c.status, c.reason) for c in p.status.conditions] == [("PodScheduled", "False", "Unschedulable")]
    assert "state" not in _status(server, "stuck")

    reactor.set_mode(auto(delay=0.05), cluster="stuck")
    assert reactor.wait_ready("stuck")["status"]["readyWorkerReplicas"] == 2


def test_reactor_preempt_drops_and_restores_a_slice(server, reactor):
    server.create_object(raycluster("pre", replicas=2, hosts=4))
    reactor.wait_ready("pre")
    old_names = {p["metadata"]["labels"]["ray.io/worker-group-replica-name"]
                 for p in reactor.pods("pre", labels={"ray.io/worker-group-replica-index": "1"})}
    seen: list[int] = []
    server.on_change(
        lambda ev: ev.plural == "rayclusters" and seen.append(ev.object["status"].get("readyWorkerReplicas", 0)))

    deleted = reactor.preempt("pre", 1, host_index=2)  # one host lost: KubeRay replaces the whole slice
    assert len(deleted) == 1
    server.wait_for(lambda: 4 in seen)  # the slice's ready count dropped...
    rc = reactor.wait_ready("pre")
    assert rc["status"]["readyWorkerReplicas"] == 8 and rc["status"]["state"] == "ready"  # ...and came back
    slice1 = reactor.pods("pre", labels={"ray.io/worker-group-replica-index": "1"})
    assert len(slice1) == 4
    new_names = {p["metadata"]["labels"]["ray.io/worker-group-replica-name"] for p in slice1}
    assert len(new_names) == 1 and new_names.isdisjoint(old_names)

    # while the slice is down, state stays "ready" (never reset), counts tell the truth
    reactor.set_mode(hold(), cluster="pre")
    reactor.preempt("pre", 0)
    server.wait_for(lambda: len(reactor.pods("pre")) == 9 and _status(server, "pre").get("readyWorkerReplicas") == 4)
    assert _status(server, "pre")["state"] == "ready"


def test_reactor_replica_failure_condition(server, reactor):
    reactor.set_mode(replica_failure(message="pods \"x\" is forbidden: exceeded quota"), cluster="rf")
    server.create_object(raycluster("rf", replicas=1, hosts=2))
    server.wait_for(lambda: any(c["type"] == "ReplicaFailure" for c in _status(server, "rf").get("conditions", [])))
    cond = next(c for c in _status(server, "rf")["conditions"] if c["type"] == "ReplicaFailure")
    assert (cond["status"], cond["reason"]) == ("True", "FailedCreateWorkerPod") and "exceeded quota" in cond["message"]
    assert len(reactor.pods("rf", labels={"ray.io/node-type": "worker"})) == 0
    reactor.clear_mode("rf")
    rc = reactor.wait_ready("rf")
    assert all(c["type"] != "ReplicaFailure" for c in rc["status"]["conditions"])


def test_reactor_delete_removes_pods(server, custom, core):
    with KubeRayReactor(server, delay=0.02, stagger=0.0, delete_delay=0.3) as reactor:
        custom.create_namespaced_custom_object(G, V, NS, "rayclusters", raycluster("del", replicas=1, hosts=2))
        reactor.wait_ready("del")
        assert FINALIZER in server.get_object("rayclusters", NS, "del")["metadata"]["finalizers"]
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "del")
        got = custom.get_namespaced_custom_object(G, V, NS, "rayclusters", "del")  # still terminating
        assert got["metadata"]["deletionTimestamp"]
        terminating = server.wait_for(
            lambda: [p for p in reactor.pods("del") if p["metadata"].get("deletionTimestamp")])
        assert len(terminating) == 3 and server.get_object("rayclusters", NS, "del") is not None
        server.wait_for(lambda: server.get_object("rayclusters", NS, "del") is None, timeout=3)
        assert core.list_namespaced_pod(NS, label_selector="ray.io/cluster=del").items == []
        assert server.get_object("services", NS, "del-head-svc") is None

        reactor.delete_delay = 0
        server.create_object(raycluster("fast", replicas=1, hosts=1))
        reactor.wait_ready("fast")
        custom.delete_namespaced_custom_object(G, V, NS, "rayclusters", "fast")
        server.wait_for(lambda: not reactor.pods("fast"), timeout=2)


async def test_pod_watch_with_field_selector(server, aapi, reactor):
    core = aclient.CoreV1Api(aapi)
    reactor.set_mode(hold())
    await aclient.CustomObjectsApi(aapi).create_namespaced_custom_object(
        G, V, NS, "rayclusters", raycluster("pw", replicas=1, hosts=2))
    running = []

    async def consume():
        async with awatch.Watch().stream(core.list_namespaced_pod, NS, label_selector="ray.io/cluster=pw",
                                         field_selector="status.phase=Running", timeout_seconds=5) as stream:
            async for ev in stream:
                running.append((ev["type"], ev["object"].status.phase))
                if len(running) == 3:
                    return

    task = asyncio.create_task(consume())
    await asyncio.to_thread(server.wait_for, lambda: len(reactor.pods("pw")) == 3)
    assert not running  # Pending pods do not match status.phase=Running
    reactor.set_mode(auto())
    await asyncio.wait_for(task, 5)
    assert running == [("ADDED", "Running")] * 3  # Pending -> Running enters the selection


async def test_rayservice_status_helper(server, aapi, reactor):
    api = aclient.CustomObjectsApi(aapi)
    await api.create_namespaced_custom_object(G, V, NS, "rayservices", {
        "apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "svc"},
        "spec": {"serveConfigV2": "applications: []", "rayClusterConfig": raycluster("x")["spec"]}})
    reactor.set_service_status("svc", conditions={"Ready": False, "UpgradeInProgress": False},
                               active={"app": "DEPLOYING"}, active_cluster="svc-abcde")
    reactor.set_service_status("svc", conditions={"Ready": True},
                               active={"app": {"status": "RUNNING",
                                               "serveDeploymentStatuses": {"D": {"status": "HEALTHY"}}}},
                               pending={"app": "NOT_STARTED"}, num_serve_endpoints=1)
    got = await api.get_namespaced_custom_object_status(G, V, NS, "rayservices", "svc")
    st = got["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "NonZeroServeEndpoints"
    assert conds["UpgradeInProgress"]["status"] == "False"
    assert st["activeServiceStatus"]["applicationStatuses"]["app"]["status"] == "RUNNING"
    assert st["activeServiceStatus"]["rayClusterName"] == "svc-abcde"
    assert st["pendingServiceStatus"]["applicationStatuses"]["app"]["status"] == "NOT_STARTED"
    assert st["numServeEndpoints"] == 1 and st["serviceStatus"] == "Running"
