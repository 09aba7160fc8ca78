"""A RayCluster in a Kueue LocalQueue: the label we render, and what a wait says while Kueue holds it.

The Workloads here have the fields and condition reasons of Kueue v0.17's v1beta2 API
(``apis/kueue/v1beta2/workload_types.go``; the Inadmissible messages of
``pkg/controller/core/workload_controller.go``); tests/controlplane/test_kueue.py reads real ones.
"""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
from airflow_provider_raytpu.status import Phase, ReconcileFailureGrace, read_ray_cluster
from airflow_provider_raytpu.status.kueue import QUEUE_NAME_LABEL, describe_hold, held_in, held_status
from airflow_provider_raytpu.tpu import TpuSlice

PENDING = ("couldn't assign flavors to pod set workers-tpu: insufficient unused quota for google.com/tpu in "
           "flavor v6e-2x2, 4 more needed")


def workload(reserved: dict[str, Any] | None = None, *, admitted_to: str = "", evicted: dict[str, Any] | None = None,
             flavor: str = "v6e-2x2") -> dict[str, Any]:
    conditions = []
    if reserved is not None:
        conditions.append({"type": "QuotaReserved", "lastTransitionTime": "2026-12-04T10:00:00Z", **reserved})
    if evicted is not None:
        conditions.append({"type": "Evicted", "status": "True", **evicted})
    status: dict[str, Any] = {"conditions": conditions}
    if admitted_to:
        status["admission"] = {"clusterQueue": admitted_to, "podSetAssignments": [
            {"name": "head", "flavors": {"cpu": "default"}},
            {"name": "workers-tpu", "flavors": {"google.com/tpu": flavor}}]}
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "status": status}


def queued_cluster(queue: str = "tpu", *, suspended: bool = True) -> dict[str, Any]:
    manifest = build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v6e", "2x2"),
                                 options=RayClusterOptions().queued_in(queue))
    manifest["spec"]["suspend"] = suspended  # what Kueue's webhook sets when the cluster is made
    return manifest


def test_queue_name_renders_kueues_label_and_nothing_else() -> None:
    plain = build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v6e", "2x2"))
    queued = build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v6e", "2x2"),
                               options=RayClusterOptions(labels={"team": "ml"}).queued_in("tpu-v6e"))
    assert queued["metadata"]["labels"] == {**plain["metadata"]["labels"], "team": "ml", QUEUE_NAME_LABEL: "tpu-v6e"}
    assert queued["spec"] == plain["spec"]  # Kueue suspends it; we never write suspend ourselves


@pytest.mark.parametrize("bad", ["Tpu", "tpu_v6e", "-tpu", "x" * 64, 7])
def test_a_bad_queue_name_fails_when_the_dag_is_parsed(bad: object) -> None:
    with pytest.raises(InvalidInputError,
                       match=r"queue_name=.*is not a Kueue LocalQueue name.*kubectl get localqueues"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2", queue_name=bad)  # type: ignore[arg-type]


def test_a_templated_queue_name_is_checked_at_run_time_and_labels_may_not_name_another() -> None:
    CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2", queue_name="{{ params.queue }}")
    with pytest.raises(InvalidInputError, match="names another queue than queue_name='tpu'"):
        RayClusterOptions(labels={QUEUE_NAME_LABEL: "cpu"}).queued_in("tpu")


def test_the_queue_as_a_label_still_counts_and_warns_naming_queue_name() -> None:
    from airflow.exceptions import AirflowProviderDeprecationWarning

    from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

    said = r"The Kueue queue as labels\['kueue.x-k8s.io/queue-name'\] is deprecated: write queue_name='tpu-v6e'"
    with pytest.warns(AirflowProviderDeprecationWarning, match=said):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2",
                                 cluster_options={"labels": {QUEUE_NAME_LABEL: "tpu-v6e"}})


def test_a_cluster_kueue_holds_is_queued_with_its_clusterqueue_and_why() -> None:
    cluster = queued_cluster()
    status = read_ray_cluster(cluster)
    assert status.phase is Phase.SUSPENDED and held_in(cluster, status) == "tpu"
    held = held_status(status, "tpu", workload({"status": "False", "reason": "Pending", "message": PENDING}), "cq-v6e")
    assert held.phase is Phase.PROVISIONING and not held.reconcile_failing
    assert held.message == f"queued in Kueue: ClusterQueue cq-v6e, Pending: {PENDING}"


def test_an_unqueued_or_running_cluster_is_not_held() -> None:
    plain = build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v6e", "2x2"))
    plain["spec"]["suspend"] = True  # suspended by a person, not by Kueue
    assert held_in(plain, read_ray_cluster(plain)) is None
    admitted = queued_cluster(suspended=False)
    assert held_in(admitted, read_ray_cluster(admitted)) is None


@pytest.mark.parametrize(("record", "cluster_queue", "held", "line"), [
    (None, None, True, "queued in Kueue: LocalQueue tpu, no Workload for it yet"),
    (workload({"status": "False", "reason": "Pending", "message": PENDING}), None, True,
     f"queued in Kueue: LocalQueue tpu, Pending: {PENDING}"),
    (workload({"status": "True", "reason": "QuotaReserved", "message": "Quota reserved in ClusterQueue cq-v6e"},
              admitted_to="cq-v6e"), "cq-v6e", True,
     "admitted by Kueue to ClusterQueue cq-v6e (flavor default, v6e-2x2); starting"),
    (workload({"status": "True", "reason": "QuotaReserved"}, admitted_to="cq-v6e"), "cq-v6e", False,
     "admitted by Kueue to ClusterQueue cq-v6e (flavor default, v6e-2x2); provisioning"),
    (workload({"status": "False", "reason": "Pending", "message": PENDING},
              evicted={"reason": "Preempted", "message": "Preempted to accommodate a workload (UID: 1) due to "
                       "prioritization in the ClusterQueue"}), "cq-v6e", True,
     "queued in Kueue: ClusterQueue cq-v6e, evicted (Preempted: Preempted to accommodate a workload (UID: 1) due to "
     f"prioritization in the ClusterQueue), queued again; Pending: {PENDING}"),
])
def test_what_kueue_does_with_a_cluster_reads_as_one_line(record: dict[str, Any] | None, cluster_queue: str | None,
                                                          held: bool, line: str) -> None:
    assert describe_hold("tpu", record, cluster_queue, held=held)[0] == line


def test_a_queue_kueue_cannot_admit_to_fails_the_wait_after_its_grace() -> None:
    status = read_ray_cluster(queued_cluster("tpuu"))
    inadmissible = workload({"status": "False", "reason": "Inadmissible", "message": "LocalQueue tpuu doesn't exist",
                             "lastTransitionTime": "2026-12-04T10:00:00Z"})
    held = held_status(status, "tpuu", inadmissible, None)
    assert held.message == "queued in Kueue: LocalQueue tpuu, Inadmissible: LocalQueue tpuu doesn't exist"
    grace = ReconcileFailureGrace(600)
    began = 1796378400.0  # 2026-12-04T10:00:00Z
    assert grace.judge(held, began + 599).phase is Phase.PROVISIONING
    failed = grace.judge(held, began + 601)
    assert failed.phase is Phase.FAILED
    assert failed.message.startswith("Kueue could not admit it for 601 s, longer than the grace period of 600 s: "
                                     "queued in Kueue: LocalQueue tpuu, Inadmissible")
