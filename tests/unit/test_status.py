"""Reading RayCluster status: READY only when the head and every host of every slice are ready."""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import (
    ClusterStatus,
    Phase,
    ReconcileFailureGrace,
    diagnose_pods,
    read_ray_cluster,
    read_slices,
)
from airflow_provider_raytpu.tpu import TpuSlice


def cluster_with(status: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    manifest = build_ray_cluster(name="c", namespace="ml", tpu=TpuSlice("v6e", "4x4", num_slices=2))
    manifest["metadata"].update(metadata)
    manifest["status"] = status
    return manifest


def condition(kind: str, status: str = "True", **extra: str) -> dict[str, str]:
    return {"type": kind, "status": status, **extra}


READY = {
    "state": "ready",
    "desiredWorkerReplicas": 8,
    "readyWorkerReplicas": 8,
    "conditions": [condition("HeadPodReady"), condition("RayClusterProvisioned")],
}


def pod(name: str, node_type: str = "worker", replica: str | None = "0", ready: bool = True, phase: str = "Running",
        **status: Any) -> dict[str, Any]:
    labels = {"ray.io/node-type": node_type}
    if replica is not None and node_type == "worker":
        labels |= {"ray.io/worker-group-replica-index": replica, "ray.io/replica-host-index": name[-1]}
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"phase": phase, "conditions": [condition("Ready", "True" if ready else "False")], **status},
    }


def test_missing_cluster_is_gone() -> None:
    assert read_ray_cluster(None).phase is Phase.GONE


def test_ready_needs_head_and_all_hosts() -> None:
    status = read_ray_cluster(cluster_with(READY))
    assert status.phase is Phase.READY and status.message == "head ready; 8 of 8 TPU hosts ready"


def test_state_ready_is_not_trusted_when_hosts_are_missing() -> None:
    # A preempted slice: KubeRay keeps state "ready" but the counts drop.
    status = read_ray_cluster(cluster_with({**READY, "readyWorkerReplicas": 4}))
    assert status.phase is Phase.PROVISIONING
    assert "4 of 8 TPU hosts ready" in status.message


def test_head_not_ready() -> None:
    status = read_ray_cluster(cluster_with({**READY, "conditions": [condition("HeadPodReady", "False")]}))
    assert status.phase is Phase.PROVISIONING and status.message.startswith("head not ready")


def test_no_status_yet() -> None:
    status = read_ray_cluster(cluster_with({}))
    assert (status.phase, status.ready_hosts, status.desired_hosts) == (Phase.PROVISIONING, 0, 8)


def test_stale_desired_count_is_not_ready() -> None:
    assert read_ray_cluster(cluster_with({**READY, "desiredWorkerReplicas": 4, "readyWorkerReplicas": 4})).phase is (
        Phase.PROVISIONING
    )


def test_not_yet_reconciled_generation() -> None:
    status = read_ray_cluster(cluster_with({**READY, "observedGeneration": 1}, generation=2))
    assert status.phase is Phase.PROVISIONING and "not yet reconciled" in status.message


def test_a_replica_failure_is_progress_with_its_reason_and_since_when() -> None:
    # KubeRay sets ReplicaFailure on any reconcile error and removes it on the next good reconcile.
    failure = condition("ReplicaFailure", reason="FailedCreateWorkerPod", message="pods forbidden: quota exceeded",
                        lastTransitionTime="2026-12-03T10:00:00Z")
    status = read_ray_cluster(cluster_with({**READY, "readyWorkerReplicas": 4,
                                            "conditions": [*READY["conditions"], failure]}))
    assert status.phase is Phase.PROVISIONING and not status.finished and status.reconcile_failing
    assert (status.reason, status.failing_since) == ("FailedCreateWorkerPod", "2026-12-03T10:00:00Z")
    assert status.message == ("KubeRay cannot reconcile it since 2026-12-03T10:00:00Z (FailedCreateWorkerPod: pods "
                              "forbidden: quota exceeded); 4 of 8 TPU hosts ready")
    assert ClusterStatus.from_dict(status.to_dict()) == status
    assert not read_ray_cluster(cluster_with(READY)).reconcile_failing


def test_a_reconcile_failure_fails_only_after_the_grace_period() -> None:
    failure = condition("ReplicaFailure", reason="FailedCreateWorkerPod", message="exceeded quota",
                        lastTransitionTime="2026-12-03T10:00:00Z")
    status = read_ray_cluster(cluster_with({**READY, "conditions": [*READY["conditions"], failure]}))
    began = 1796292000.0  # 2026-12-03T10:00:00Z
    grace = ReconcileFailureGrace(600)
    assert grace.judge(status, began + 599) is status and grace.seconds_left(status, began + 599) == 1
    failed = grace.judge(status, began + 601)
    assert failed.phase is Phase.FAILED and failed.reason == "FailedCreateWorkerPod"
    assert failed.message.startswith("KubeRay could not reconcile it for 601 s, longer than the grace period of 600 s: "
                                     "KubeRay cannot reconcile it since 2026-12-03T10:00:00Z (FailedCreateWorkerPod")
    # Without lastTransitionTime the clock starts when the waiter first sees the failure, and stops when it clears.
    unstamped = read_ray_cluster(cluster_with({**READY, "conditions": [*READY["conditions"], condition(
        "ReplicaFailure", reason="FailedCreateWorkerPod")]}))
    grace = ReconcileFailureGrace(10)
    assert grace.judge(unstamped, 100).phase is Phase.PROVISIONING
    assert grace.judge(unstamped, 110).phase is Phase.FAILED
    assert grace.judge(read_ray_cluster(cluster_with(READY)), 111).phase is Phase.READY
    assert grace.judge(unstamped, 112).phase is Phase.PROVISIONING and grace.seconds_left(unstamped, 112) == 10


def test_state_failed_is_fatal() -> None:
    # KubeRay v1.5+ never sets it; the local backend does for Ray processes that cannot start.
    status = read_ray_cluster(cluster_with({**READY, "state": "failed", "reason": "HeadFailed: the Ray head failed"}))
    assert status.phase is Phase.FAILED and status.reason == "HeadFailed"
    assert status.message == "the RayCluster failed: HeadFailed: the Ray head failed"


def test_suspended() -> None:
    assert read_ray_cluster(cluster_with({"state": "suspended"})).phase is Phase.SUSPENDED
    assert read_ray_cluster(cluster_with({**READY, "conditions": [condition("RayClusterSuspended")]})).phase is (
        Phase.SUSPENDED
    )


def test_resumed_is_provisioning_while_kuberays_status_still_says_suspended() -> None:
    resumed = cluster_with({"state": "suspended", "conditions": [condition("RayClusterSuspended")]})
    resumed["spec"]["suspend"] = False  # what Kueue writes when it admits the cluster
    status = read_ray_cluster(resumed)
    assert status.phase is Phase.PROVISIONING and status.message == "head not ready; 0 of 8 TPU hosts ready"


def test_being_deleted_is_gone() -> None:
    assert read_ray_cluster(cluster_with(READY, deletionTimestamp="2026-12-02T00:00:00Z")).phase is Phase.GONE


def test_per_slice_detail_from_pods() -> None:
    pods = [pod("h", "head")] + [pod(f"s0-{i}", replica="0") for i in range(4)]
    pods += [pod(f"s1-{i}", replica="1", ready=i < 2) for i in range(4)]
    status = read_ray_cluster(cluster_with({**READY, "readyWorkerReplicas": 6}), pods)
    assert status.phase is Phase.PROVISIONING
    assert status.message == "head ready; 6 of 8 TPU hosts ready (slice 0: 4/4, slice 1: 2/4)"
    assert [s.ready_hosts for s in status.slices] == [4, 2]


def test_a_terminating_pod_is_no_ready_host() -> None:
    """KubeRay deletes a slice to make it again (a lost host); its old pods stay Ready until they stop."""
    pods = [pod("h", "head")] + [pod(f"s0-{i}", replica="0") for i in range(4)]
    pods += [pod(f"s1-{i}", replica="1") for i in range(4)]
    for terminating in pods[5:7]:
        terminating["metadata"]["deletionTimestamp"] = "2026-12-04T10:04:45Z"
    status = read_ray_cluster(cluster_with(READY), pods)  # KubeRay's counts still say 8 of 8
    assert status.phase is Phase.PROVISIONING
    assert [s.ready_hosts for s in status.slices] == [4, 2] and status.message.endswith("(slice 0: 4/4, slice 1: 2/4)")


def test_slices_sort_numerically() -> None:
    pods = [pod(f"p{i}", replica=str(i)) for i in (10, 2, 1)]
    assert [s.index for s in read_slices(pods)] == ["1", "2", "10"]


def test_status_round_trips_through_json() -> None:
    status = read_ray_cluster(cluster_with(READY), [pod("a0")])
    assert ClusterStatus.from_dict(status.to_dict()) == status
    data = status.to_dict()
    assert json.loads(json.dumps(data)) == data and isinstance(data["slices"], list)


def test_diagnosis_names_unready_hosts_and_the_scheduler_reason() -> None:
    unschedulable = {
        "conditions": [
            condition("PodScheduled", "False", reason="Unschedulable",
                      message="0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."),
        ]
    }
    pods = [pod("head", "head"), pod("w-0", ready=False, phase="Pending", **unschedulable),
            pod("w-1", ready=False, phase="Pending"), pod("w-2")]
    events = [{"involvedObject": {"name": "w-1"}, "type": "Warning", "reason": "FailedScheduling",
               "message": "0/3 nodes are available: 3 Insufficient google.com/tpu.",
               "lastTimestamp": "2026-12-02T00:00:01Z"}]
    status = read_ray_cluster(cluster_with({**READY, "readyWorkerReplicas": 1}), pods)
    text = diagnose_pods(status, pods, events)
    assert "slice 0 host 0 (pod w-0): Unschedulable: 0/3 nodes are available" in text
    assert "slice 0 host 1 (pod w-1): FailedScheduling: 0/3 nodes are available: 3 Insufficient google.com/tpu." in text
    assert "w-2" not in text
    assert "5 TPU host pod(s) not created yet" in text


@pytest.mark.parametrize("ready_hosts", [0, 7])
def test_partial_counts_are_provisioning(ready_hosts: int) -> None:
    assert not read_ray_cluster(cluster_with({**READY, "readyWorkerReplicas": ready_hosts})).finished
