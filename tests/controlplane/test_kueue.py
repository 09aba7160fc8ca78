"""RayClusters queued in Kueue (v0.17, real, built from its Go module) on the real control plane.

A ClusterQueue has quota for one v6e 2x2 slice (4 chips) while three nodes could hold three. Three runs of
one DAG (create with ``queue_name`` -> wait -> train -> teardown), started together, are admitted one at a
time; the waiting sensors say so, each teardown deletes its own cluster, and the usage each reports counts
the chips from ready to gone, not the time queued.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.kueue import NAMESPACE_LABEL, Kueue
from tests.controlplane.parallel_runs import run_in_parallel
from tests.controlplane.support import (
    V6E,
    Connections,
    NodePools,
    force_delete_clusters,
    get_json,
    lifecycle_dag,
    states,
    suffix,
    wait_no_pods,
)
from tests.controlplane.support import (
    documented_role as documented_role_rules,
)
from tests.support.airflow_runner import run_dag
from tests.support.processes import BinariesNotBuilt

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600), pytest.mark.usefixtures("documented_role")]

CLUSTER_QUEUE = "tpu-v6e"
TPU_LABELS = {"cloud.google.com/gke-tpu-accelerator": V6E, "cloud.google.com/gke-tpu-topology": "2x2"}
HOLD_SECONDS = 30  # against ~0.2 s between the teardown's and this test's sight of gone: within 1 %

DAG = f"""
from datetime import datetime
from airflow.sdk import DAG, task
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG("kueue_nightly", schedule=None, start_date=datetime(2026, 1, 1), default_args={{"retries": 0}}):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2", queue_name="tpu")
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=420, poke_interval=1)

    @task
    def train():
        import time

        time.sleep({HOLD_SECONDS})

    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster=create.output, wait_for_deletion=True,
                                      deletion_timeout=120, poll_interval=0.1)
    create >> ready >> train() >> delete.as_teardown(setups=create)
"""


@pytest.fixture(scope="module")
def kueue(k8s_control_plane: ControlPlane) -> Iterator[Kueue]:
    try:
        with Kueue.start(k8s_control_plane) as running:
            running.flavor("default", {})
            running.flavor("v6e-2x2", TPU_LABELS)
            running.cluster_queue(CLUSTER_QUEUE, [
                (["cpu", "memory"], {"default": {"cpu": "1000", "memory": "10000Gi"}}),
                (["google.com/tpu"], {"v6e-2x2": {"google.com/tpu": "4"}}),  # one v6e 2x2 slice
            ])
            yield running
            running.delete_cluster_queue(CLUSTER_QUEUE)
    except BinariesNotBuilt as exc:
        if os.environ.get("RAYTPU_REQUIRE_K8S") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture
def namespace(k8s_control_plane: ControlPlane, kueue: Kueue) -> Iterator[str]:
    """A namespace Kueue's webhooks act in, with the LocalQueue ``tpu`` of the ClusterQueue."""
    ns = k8s_control_plane.create_namespace(f"kueue-{suffix()}", labels={NAMESPACE_LABEL: "enabled"})
    kueue.local_queue(ns, "tpu", CLUSTER_QUEUE)
    yield ns
    force_delete_clusters(k8s_control_plane, ns)


@pytest.fixture
def documented_role(connections: Connections) -> None:
    """The tasks connect as the least-privilege Role users are given (docs/rbac.yaml), which reads Kueue's
    Workloads and LocalQueues."""
    connections.as_role(documented_role_rules())


class ClusterClock:
    """Watches a namespace's RayClusters from the test, every 0.1 s: when each was admitted (unsuspended),
    ready (KubeRay's ``stateTransitionTimes.ready``) and gone (neither it nor a pod of it left)."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.namespace = cp, namespace
        self.seen: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ClusterClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            now = datetime.now(UTC)
            _, clusters = get_json(self.cp, f"/apis/ray.io/v1/namespaces/{self.namespace}/rayclusters")
            _, pods = get_json(self.cp, f"/api/v1/namespaces/{self.namespace}/pods")
            names = {c["metadata"]["name"]: c for c in clusters.get("items", [])}
            with_pods = {(p["metadata"].get("labels") or {}).get("ray.io/cluster") for p in pods.get("items", [])}
            for name, cluster in names.items():
                record = self.seen.setdefault(name, {"created": now})
                if not cluster["spec"].get("suspend"):
                    record.setdefault("admitted", now)
                if ready := ((cluster.get("status") or {}).get("stateTransitionTimes") or {}).get("ready"):
                    record["ready"] = datetime.fromisoformat(ready.replace("Z", "+00:00"))
            for name, record in self.seen.items():
                if name not in names and name not in with_pods:
                    record.setdefault("gone", now)


def test_three_runs_on_a_one_slice_queue_are_admitted_one_at_a_time(
        airflow_home: Path, k8s_control_plane: ControlPlane, node_pools: NodePools, head_nodes: list[str],
        namespace: str, kueue: Kueue) -> None:
    cp = k8s_control_plane
    node_pools.add("v6e-queued", tpu=V6E, topology="2x2", num_nodes=3)  # room for three slices: Kueue decides
    dates = [datetime(2026, 12, 1 + i, 2, 0, tzinfo=UTC) for i in range(3)]
    with ClusterClock(cp, namespace) as clock:
        runs = run_in_parallel(airflow_home, DAG, "kueue_nightly", dates)
    for run in runs:
        assert states(run.outcome) == {"create_cluster": "success", "wait_ready": "success", "train": "success",
                                       "delete_cluster": "success"}, run.log[-4000:]
    names = [run.outcome["create_cluster"].result["cluster_name"] for run in runs]
    assert len(set(names)) == 3 and set(clock.seen) == set(names), clock.seen
    # Each teardown deleted its own run's cluster, and only it.
    assert [run.outcome["delete_cluster"].result["cluster_names"] for run in runs] == [[name] for name in names]

    # Admitted one at a time: each cluster was admitted only after the one before it was gone.
    spans = sorted((clock.seen[name]["admitted"], clock.seen[name]["gone"], name) for name in names)
    for (_, gone, first), (admitted, _, then) in zip(spans, spans[1:], strict=False):
        assert admitted >= gone - timedelta(seconds=0.2), (first, gone, then, admitted)
    # The clusters that waited said so in their sensors' logs, with the ClusterQueue and Kueue's reason.
    waited = [run for run, name in zip(runs, names, strict=True)
              if clock.seen[name]["admitted"] - clock.seen[name]["created"] > timedelta(seconds=3)]
    assert len(waited) >= 2, clock.seen
    for run in waited:
        assert (f"queued in Kueue: ClusterQueue {CLUSTER_QUEUE}, Pending: couldn't assign flavors to pod set "
                in run.log), run.log[-4000:]
        assert "insufficient unused quota for google.com/tpu in flavor v6e-2x2" in run.log

    # Chip-hours from ready to gone, as the test's own clock saw them: the time queued is not counted.
    for run, name in zip(runs, names, strict=True):
        (usage,) = run.outcome["delete_cluster"].xcoms["tpu_usage"]
        seen = clock.seen[name]
        ready_to_gone = (seen["gone"] - seen["ready"]).total_seconds() / 3600
        assert usage["chip_hours"]["on-demand"] == pytest.approx(4 * ready_to_gone, rel=0.01), (usage, seen)
    wait_no_pods(cp, namespace)
    assert json.dumps(kueue.workloads(namespace)) == "[]"  # Kueue's Workloads went with their clusters


def test_an_admitted_cluster_without_nodes_is_diagnosed_as_unschedulable_not_queued(
        airflow_home: Path, k8s_control_plane: ControlPlane, head_nodes: list[str], namespace: str,
        capfd: pytest.CaptureFixture[str]) -> None:
    """The queue has quota but no TPU node exists: Kueue admits the cluster, the scheduler cannot place its host,
    and the sensor's timeout says both, apart."""
    source = lifecycle_dag("kueue_no_nodes", create={"cluster_name": "nonodes", "accelerator": "v6e", "topology": "2x2",
                                                     "queue_name": "tpu"}, sensor_timeout=8, retries=0)
    outcome = run_dag(airflow_home, source, "kueue_no_nodes")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "failed", "delete_cluster": "success"}
    log = capfd.readouterr().out
    assert (f"RayCluster {namespace}/nonodes not ready after 8 s.\nPROVISIONING: head ready; 0 of 1 TPU hosts ready "
            f"(slice 0: 0/1)\n- Kueue: admitted by Kueue to ClusterQueue {CLUSTER_QUEUE} (flavor default, v6e-2x2); "
            "provisioning\n- slice 0 (pod nonodes-tpu-slices-worker-") in log
    assert "Unschedulable: 0/" in log and "didn't match Pod's node affinity/selector" in log
    assert "queued in Kueue" not in log
