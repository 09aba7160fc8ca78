"""Capacity on the real kube-scheduler: each kind's host pods land on the node pool of that kind only, and a
create task given a list falls back from a kind that places nothing to the next.

Four v6e 2x2 pools of the same shape differ only in what GKE puts on their nodes: a plain on-demand pool, a
pool consuming the reservation ``nightly-v6e`` (``cloud.google.com/reservation-name`` and ``-affinity``), a
flex-start pool (``cloud.google.com/gke-flex-start``) and a spot pool (``cloud.google.com/gke-spot`` and its
taint). A cluster of each capacity must become READY on its own pool, which only the rendered node selector
and tolerations can decide.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import V6E, NodePools, get_json, lifecycle_dag, rayclusters, states, wait_no_pods
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(420), pytest.mark.usefixtures("admin_connections")]

RESERVED = {"cloud.google.com/reservation-name": "nightly-v6e", "cloud.google.com/reservation-affinity": "specific"}
FLEX_START = {"cloud.google.com/gke-flex-start": "true"}


@pytest.fixture(scope="module")
def pools(module_node_pools: NodePools, head_nodes: list[str]) -> dict[str, list[str]]:
    """One single-host v6e 2x2 node per capacity kind."""
    made = {kind: module_node_pools.add(f"v6e-{kind}", tpu=V6E, topology="2x2", labels=labels).nodes
            for kind, labels in (("on-demand", {}), ("reserved", RESERVED), ("flex", FLEX_START))}
    return {**made, "spot": module_node_pools.add("v6e-spot", tpu=V6E, topology="2x2", spot=True).nodes}


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


FALLBACK = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("capacity_fallback", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 0}):
    create = CreateRayClusterOperator(task_id="create_cluster", cluster_name="fallback", accelerator="v6e",
                                      topology="2x2", capacity=["reservation:used-up", "spot"], fallback_after=6)
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=240, poke_interval=1)
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster=create.output, wait_for_deletion=True,
                                      deletion_timeout=120, poll_interval=0.5)
    create >> ready >> delete.as_teardown(setups=create)
"""


def test_a_reservation_that_places_nothing_falls_back_to_spot_once(
        airflow_home: Path, k8s_control_plane: ControlPlane, pools: dict[str, list[str]], namespace: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    """No node consumes the reservation ``used-up``: after ``fallback_after`` the cluster is deleted and made on
    spot, whose host lands on the spot pool; the create task's ``capacity`` XCom records both kinds."""
    cp = k8s_control_plane
    outcome = run_dag(airflow_home, FALLBACK, "capacity_fallback")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success",
                               "delete_cluster": "success"}, outcome
    create = outcome["create_cluster"]
    assert create.try_number == 1 and create.result["tpu"]["capacity"] == "spot"
    assert create.xcoms["capacity"] == {"used": "spot", "tried": [
        {"capacity": "reservation:used-up", "outcome": create.xcoms["capacity"]["tried"][0]["outcome"]},
        {"capacity": "spot", "outcome": "the last kind listed: kept"}]}
    assert create.xcoms["capacity"]["tried"][0]["outcome"].startswith("0 of 1 TPU hosts placed in ")
    log = capfd.readouterr().out
    switches = [line for line in log.splitlines() if "deleting it to make it on spot" in line]
    assert len(switches) == 1, switches
    assert f"RayCluster {namespace}/fallback: reservation used-up has 0 of 1 TPU hosts placed in " in switches[0]
    assert "didn't match Pod's node affinity/selector" in log  # the pending host's reason, in the diagnosis
    # The teardown deleted the one cluster there is; the spot host had run on the spot pool.
    assert outcome["delete_cluster"].result["cluster_names"] == ["fallback"]
    # Its usage, from the ready time the real KubeRay recorded (stateTransitionTimes) to gone: spot only.
    (usage,) = outcome["delete_cluster"].xcoms["tpu_usage"]
    assert (usage["capacity"], usage["chips"], usage["slices_recreated"]) == ("spot", 4, 0)
    # Both figures are rounded to 6 decimals on their own: 4 x a rounded figure differs in the last place.
    assert usage["ready_at"] is not None
    assert 0 < usage["chip_hours"]["spot"] == pytest.approx(4 * usage["hours"], abs=4e-6)
    assert rayclusters(cp, namespace) == []
    status, events = get_json(cp, f"/api/v1/namespaces/{namespace}/events")
    hosts = [e["message"] for e in events["items"] if e["reason"] == "Scheduled" and "-worker-" in e["message"]]
    assert status == 200 and len(hosts) == 1 and hosts[0].endswith(f" to {pools['spot'][0]}"), hosts
    wait_no_pods(cp, namespace)
