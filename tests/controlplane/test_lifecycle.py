"""The cluster lifecycle through Airflow (``dag.test()``) against the real control plane.

A ``raytpu`` connection of backend ``kubernetes`` points at the real API server; the
real KubeRay operator makes the pods, the real kube-scheduler places them on fake GKE
TPU nodes, the virtual kubelet reports them running.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import (
    HOST_INDEX,
    REPLICA_INDEX,
    REPLICA_NAME,
    TPU_ACCELERATOR_LABEL,
    TPU_TOPOLOGY_LABEL,
    V6E,
    NodePools,
    get_json,
    lifecycle_dag,
    list_pods,
    rayclusters,
    states,
    wait_no_pods,
)
from tests.support.airflow_runner import run_dag

# Each test: a fresh namespace, the connections pointing at it with the admin identity.
pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420), pytest.mark.usefixtures("admin_connections")]


@pytest.fixture(scope="module")
def v6e_4x4_nodes(module_node_pools: NodePools, head_nodes: list[str]) -> list[str]:
    """Two slices' worth of v6e 4x4 hosts (8 nodes, 4 chips each): the only TPU nodes of this module."""
    return module_node_pools.add("v6e-4x4", tpu=V6E, topology="4x4", num_nodes=8).nodes


def test_v6e_4x4_two_slices_create_ready_delete(airflow_home: Path, k8s_control_plane: ControlPlane,
                                                v6e_4x4_nodes: list[str], head_nodes: list[str],
                                                namespace: str) -> None:
    cp = k8s_control_plane
    source = lifecycle_dag("k8s_lifecycle", create={"cluster_name": "nightly", "accelerator": "v6e",
                                                    "topology": "4x4", "num_slices": 2}, snapshot=True)
    outcome = run_dag(airflow_home, source, "k8s_lifecycle")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "snapshot": "success",
                               "delete_cluster": "success"}, outcome

    reference = outcome["create_cluster"].result
    assert reference["cluster_name"] == "nightly" and reference["namespace"] == namespace
    assert reference["dashboard_url"] == (
        f"{cp.server}/api/v1/namespaces/{namespace}/services/nightly-head-svc:dashboard/proxy")
    ready = outcome["wait_ready"].result
    assert (ready["phase"], ready["head_ready"], ready["ready_hosts"], ready["desired_hosts"]) == ("READY", True, 8, 8)
    assert [(s["index"], s["ready_hosts"], s["hosts"]) for s in ready["slices"]] == [("0", 4, 4), ("1", 4, 4)]

    # What the real operator made, as seen when the sensor had said ready.
    pods = outcome["snapshot"].result
    heads = [p for p in pods if p["labels"].get("ray.io/node-type") == "head"]
    workers = [p for p in pods if p["labels"].get("ray.io/node-type") == "worker"]
    assert (len(heads), len(workers)) == (1, 8), pods
    assert all(p["ready"] and p["phase"] == "Running" for p in pods)
    assert heads[0]["node"] in head_nodes
    # One whole v6e 4x4 host per worker: 8 distinct nodes, all labelled like GKE's v6e 4x4 pool.
    assert len({p["node"] for p in workers}) == 8
    for node_name in {p["node"] for p in workers}:
        status, node = get_json(cp, f"/api/v1/nodes/{node_name}")
        assert status == 200
        assert node["metadata"]["labels"][TPU_ACCELERATOR_LABEL] == V6E
        assert node["metadata"]["labels"][TPU_TOPOLOGY_LABEL] == "4x4"
    # Each slice's 4 hosts share one replica index (and replica name), with host indices 0..3.
    slices = collections.defaultdict(list)
    for p in workers:
        slices[p["labels"][REPLICA_INDEX]].append(p)
    assert sorted(slices) == ["0", "1"]
    for members in slices.values():
        assert sorted(p["labels"][HOST_INDEX] for p in members) == ["0", "1", "2", "3"]
        assert len({p["labels"][REPLICA_NAME] for p in members}) == 1
    assert len({members[0]["labels"][REPLICA_NAME] for members in slices.values()}) == 2

    # Deleted (the operator waited for the object), and the garbage collector takes every pod.
    assert outcome["delete_cluster"].result == {"cluster_name": "nightly", "cluster_names": ["nightly"],
                                                "namespace": namespace, "deleted": True, "skipped": []}
    assert rayclusters(cp, namespace) == []
    wait_no_pods(cp, namespace)


def test_no_matching_node_pool_times_out_with_the_schedulers_reason(
        airflow_home: Path, k8s_control_plane: ControlPlane, v6e_4x4_nodes: list[str], head_nodes: list[str],
        namespace: str, capfd: pytest.CaptureFixture[str]) -> None:
    cp = k8s_control_plane
    # v6e 2x4 is one 8-chip host (GKE ct6e-standard-8t); only v6e 4x4 nodes exist, so it stays Pending.
    source = lifecycle_dag("k8s_unschedulable", create={"cluster_name": "stuck", "accelerator": "v6e",
                                                        "topology": "2x4"},
                           sensor_timeout=4, gate_unschedulable_hosts=1, retries=0)
    outcome = run_dag(airflow_home, source, "k8s_unschedulable")
    assert outcome["wait_unschedulable"].state == "success", outcome
    pending = outcome["wait_unschedulable"].result
    assert len(pending) == 1
    # A sensor timeout is not retried; the teardown still deletes the cluster.
    assert (outcome["wait_ready"].state, outcome["wait_ready"].try_number) == ("failed", 1)
    assert outcome["delete_cluster"].state == "success"

    log = capfd.readouterr().out
    assert "AirflowSensorTimeout" in log
    assert f"RayCluster {namespace}/stuck not ready after 4 s" in log
    assert "PROVISIONING: head ready; 0 of 1 TPU hosts ready (slice 0: 0/1)" in log
    for pod in pending:
        # Which pod, which slice, and the real kube-scheduler's words.
        line = next((ln for ln in log.splitlines() if f"- slice 0 (pod {pod}): " in ln), None)
        assert line is not None, f"{pod} not named in the diagnosis:\n{log[-4000:]}"
        assert "Unschedulable: 0/" in line, line
        assert "didn't match Pod's node affinity/selector" in line, line
    wait_no_pods(cp, namespace)
    assert list_pods(cp, namespace) == []
