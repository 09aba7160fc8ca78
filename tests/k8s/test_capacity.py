"""Capacity on the real kube-scheduler: each kind's host pods land on the node pool of that kind only.

Three v6e 2x2 pools of the same shape differ only in what GKE labels their nodes with: a plain on-demand
pool, a pool consuming the reservation ``nightly-v6e`` (``cloud.google.com/reservation-name`` and
``-affinity``) and a flex-start pool (``cloud.google.com/gke-flex-start``). A cluster of each capacity
must become READY on its own pool, which only the rendered node selector can decide.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.airflow_runner import run_dag
from tests.k8s.controlplane import ControlPlane
from tests.k8s.support import V6E, NodePools, lifecycle_dag, states, wait_no_pods

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420), pytest.mark.usefixtures("admin_connections")]

RESERVED = {"cloud.google.com/reservation-name": "nightly-v6e", "cloud.google.com/reservation-affinity": "specific"}
FLEX_START = {"cloud.google.com/gke-flex-start": "true"}


@pytest.fixture(scope="module")
def pools(module_node_pools: NodePools, head_nodes: list[str]) -> dict[str, list[str]]:
    """One single-host v6e 2x2 node per capacity kind; the on-demand one first, so it is no tie-break winner."""
    return {kind: module_node_pools.add(f"v6e-{kind}", tpu=V6E, topology="2x2", labels=labels).nodes
            for kind, labels in (("on-demand", {}), ("reserved", RESERVED), ("flex", FLEX_START))}


@pytest.mark.parametrize(("capacity", "pool"), [("reservation:nightly-v6e", "reserved"), ("flex-start", "flex")])
def test_a_slice_lands_on_the_pool_of_its_capacity(airflow_home: Path, k8s_control_plane: ControlPlane,
                                                   pools: dict[str, list[str]], namespace: str,
                                                   capacity: str, pool: str) -> None:
    dag_id = f"capacity_{pool}"
    source = lifecycle_dag(dag_id, create={"cluster_name": pool, "accelerator": "v6e", "topology": "2x2",
                                           "capacity": capacity}, snapshot=True)
    outcome = run_dag(airflow_home, source, dag_id)
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success", "snapshot": "success",
                               "delete_cluster": "success"}, outcome
    assert outcome["create_cluster"].result["tpu"]["capacity"] == capacity
    (host,) = [p for p in outcome["snapshot"].result if p["labels"].get("ray.io/node-type") == "worker"]
    assert host["ready"] and host["node"] in pools[pool], (host, pools)
    wait_no_pods(k8s_control_plane, namespace)
