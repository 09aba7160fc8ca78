"""Multi-slice training on the real operator: two v4 2x2x2 slices, and the loss of one of them.

The create task renders ``num_slices=2`` (``MEGASCALE_NUM_SLICES=2`` on every TPU host); the real KubeRay
operator makes two replicas of two host pods; GKE's TPU webhook (stand-in, tests/controlplane/tpuwebhook.py) gives
each host the slice's ``MEGASCALE_*``; each host runs a real raylet in a network namespace of its own. The
example train loop runs through ``JaxTrainerOperator`` with a hook (tests/ray/local_backend/multislice_loop) that
records, at the first step each worker runs, its slice, the ``MEGASCALE_*`` its host has (the webhook's)
and the ones Ray Train set in the worker (which JAX reads), and where the webhook's coordinator name
resolves.

1. An uninterrupted run: the reference. Every host's ``MEGASCALE_SLICE_ID`` is its slice's index, its
   coordinator is host 0 of slice 0; Ray Train's slice ids follow the slices, one coordinator, the
   address of world rank 0.
2. A node of slice 1 deleted (a preemption) once a checkpoint is committed: KubeRay recreates slice 1
   (index 1 again) on a replacement node, the webhook gives its new hosts the same slice identity, Ray
   Train restarts every worker on both slices from the newest checkpoint with fresh ``MEGASCALE_*`` and
   the run ends on the reference's loss within 1e-6. The steps lost and the time from the node's
   deletion to all four workers training again are printed.

Needs pod networks (CAP_NET_ADMIN): without, the module skips.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.status import Phase
from example_dags.demo.fake_gcs import FakeGcsServer
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.example_runs import BUCKET, EXAMPLES, ROWS, V4, committed_steps
from tests.controlplane.preemption import FaultThread
from tests.controlplane.support import (
    HOST_INDEX,
    NODEPOOL_LABEL,
    REPLICA_INDEX,
    NodePools,
    dashboard_get,
    lifecycle_dag,
    list_pods,
    pod_ready,
    ray_namespace,
    states,
    wait_for,
)
from tests.controlplane.tpuwebhook import check_name
from tests.support.airflow_runner import TaskOutcome, run_dag

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(900)]

LOOP = Path(__file__).resolve().parents[1] / "ray" / "local_backend" / "multislice_loop"
GROUP = "tpu-slices"
STEPS, EVERY = 30, 5
ELASTIC_STEPS = 400  # 0.2 s each at least: the run outlasts a slice's recreation
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def cp(networked_control_plane: ControlPlane) -> ControlPlane:
    return networked_control_plane


@pytest.fixture(scope="module")
def pool(cp: ControlPlane, module_node_pools: NodePools) -> str:
    """A CPU node for the head and a v4 2x2x2 pool of four hosts (two slices), all running their pods here."""
    module_node_pools.add("heads", cpu_nodes=1, host_processes=True)
    return module_node_pools.add("v4", tpu=V4, topology="2x2x2", num_nodes=4, host_processes=True).name


@pytest.fixture(scope="module")
def namespace(cp: ControlPlane) -> Iterator[str]:
    with ray_namespace(cp, "multislice") as ns:
        yield ns


@pytest.fixture(scope="module")
def cluster(airflow_home: Path, pool: str, gcs: FakeGcsServer, namespace: str) -> str:
    """Two v4 2x2x2 slices, READY as Ray sees it; the name."""
    create = {"cluster_name": "multislice", "accelerator": "v4", "topology": "2x2x2", "num_slices": 2,
              "worker_pod_template": {"spec": {"nodeSelector": {NODEPOOL_LABEL: pool}}}}
    outcome = run_dag(airflow_home, lifecycle_dag("k8s_multislice_create", create=create, delete=False),
                      "k8s_multislice_create")
    assert states(outcome) == {"create_cluster": "success", "wait_ready": "success"}, outcome
    return outcome["create_cluster"].result["cluster_name"]


# execution_timeout: pytest-timeout's alarm did not stop a training job that hung inside dag.test() (Ray Train
# waiting for a slice's placement group under load); the task's own timeout fails it instead of hanging the tier.
def train_dag(dag_id: str, cluster: str, checkpoints: str, marker_dir: Path, more: str = "", **config: Any) -> str:
    config = {"seed": 3, "total_steps": STEPS, "checkpoint_every": EVERY, "marker_dir": str(marker_dir),
              "shard_dataset": "shards", **config}
    rows = f"gs://{BUCKET}/raw/rows.jsonl"
    return f'''
from datetime import datetime, timedelta
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1)):
    JaxTrainerOperator(
        task_id="train", cluster_name={cluster!r}, train_loop="multislice_loop:train_loop_per_worker",
        checkpoint_uri={checkpoints!r}, config={config!r}, datasets={{"shards": {rows!r}}},
        runtime_env={{"py_modules": [{str(EXAMPLES / "pipeline")!r}, {str(LOOP)!r}]}},
        retries=0, deferrable=False, poll_interval=1, execution_timeout=timedelta(minutes=12), {more}
    )
'''


def records(marker_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(marker_dir.glob("rank*-step*.json"))]


def progress(marker_dir: Path) -> list[dict[str, Any]]:
    path = marker_dir / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def host_pods(cp: ControlPlane, namespace: str, cluster: str) -> list[dict[str, Any]]:
    return [p for p in list_pods(cp, namespace, f"ray.io/cluster={cluster},ray.io/group={GROUP}")
            if not p["metadata"].get("deletionTimestamp")]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    (host,) = [c for c in pod["spec"]["containers"] if c["name"] == "ray-worker"]
    return {var["name"]: var.get("value", "") for var in host.get("env") or []}


def assert_each_host_knows_its_slice(pods: list[dict[str, Any]], cluster: str) -> dict[tuple[str, str], str]:
    """Every host pod has its slice's ``MEGASCALE_*`` (ours and the webhook's); ``(slice, host) -> pod IP``."""
    coordinator = f"{GROUP}-0-0.{check_name(f'{cluster}-headless')}"
    addresses = {}
    for pod in pods:
        labels, env = pod["metadata"]["labels"], env_of(pod)
        replica = labels[REPLICA_INDEX]
        assert (env["MEGASCALE_NUM_SLICES"], env["MEGASCALE_SLICE_ID"], env["MEGASCALE_COORDINATOR_ADDRESS"],
                env["MEGASCALE_PORT"], env["TPU_NAME"]) == ("2", replica, coordinator, "8081", f"{GROUP}-{replica}")
        addresses[(replica, labels[HOST_INDEX])] = pod["status"]["podIP"]
    assert sorted(addresses) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    return addresses


def assert_workers_see_their_slices(seen: list[dict[str, Any]], coordinator_ip: str) -> None:
    """Four workers, two per slice; the hosts' (webhook's) slice ids follow the slices and name slice 0's
    first host as coordinator; Ray Train's one coordinator is world rank 0's node, its slice ids follow the
    slices too (its numbering is its own)."""
    assert sorted(r["rank"] for r in seen) == [0, 1, 2, 3] and {r["world_size"] for r in seen} == {4}
    by_slice: dict[str, list[dict[str, Any]]] = {}
    for r in seen:
        by_slice.setdefault(r["slice"], []).append(r)
    assert sorted(by_slice) == [f"{GROUP}-0", f"{GROUP}-1"] and [len(w) for w in by_slice.values()] == [2, 2]
    for name, workers in by_slice.items():
        assert {r["host_megascale"]["MEGASCALE_SLICE_ID"] for r in workers} == {name.rsplit("-", 1)[1]}
        assert {r["host_coordinator_ip"] for r in workers} == {coordinator_ip}
    assert {r["megascale"]["MEGASCALE_NUM_SLICES"] for r in seen} == {"2"}
    (rank_0,) = [r for r in seen if r["rank"] == 0]
    assert {r["megascale"]["MEGASCALE_COORDINATOR_ADDRESS"] for r in seen} == {rank_0["node_ip"]}
    ids = {name: {r["megascale"]["MEGASCALE_SLICE_ID"] for r in workers} for name, workers in by_slice.items()}
    assert sorted(map(sorted, ids.values())) == [["0"], ["1"]], ids


@pytest.fixture(scope="module")
def reference(airflow_home: Path, cp: ControlPlane, cluster: str, namespace: str,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    marker_dir = tmp_path_factory.mktemp("multislice-reference")
    outcome = run_dag(airflow_home, train_dag("k8s_multislice_reference", cluster, f"gs://{BUCKET}/multislice/ref",
                                              marker_dir), "k8s_multislice_reference")
    assert outcome["train"].state == "success", outcome
    return {"result": outcome["train"].result, "records": records(marker_dir),
            "pods": host_pods(cp, namespace, cluster)}


def test_each_host_and_worker_gets_the_megascale_environment_of_its_slice(reference: dict[str, Any],
                                                                         cluster: str) -> None:
    assert reference["result"]["steps"] == STEPS and reference["result"]["resumed_from_step"] is None
    addresses = assert_each_host_knows_its_slice(reference["pods"], cluster)
    assert_workers_see_their_slices(reference["records"], addresses[("0", "0")])
    shards = [set(r["ids"]) for r in reference["records"]]
    assert sum(len(s) for s in shards) == ROWS and set().union(*shards) == set(range(ROWS)), "disjoint shards"


@dataclass
class SliceLoss(FaultThread):
    """A test thread: once the run has committed a checkpoint, deletes the Node of a host of slice 1 and adds a
    replacement node to the pool; waits until KubeRay has recreated the slice and its hosts are Ready.

    :param away_until: ``marker_dir`` -> true once the replacement node may come (default: at once).
    """

    cp: ControlPlane
    namespace: str
    cluster: str
    pool: str
    gcs: FakeGcsServer
    prefix: str
    marker_dir: Path
    away_until: Callable[[Path], bool] = lambda _: True
    checkpointed: int = -1
    deleted_at: float = 0.0
    replaced_at: float = 0.0
    pods_after: list[dict[str, Any]] = field(default_factory=list)

    def _run(self) -> None:
        wait_for(lambda: committed_steps(self.gcs, self.prefix), 600, "a committed checkpoint", interval=0.2)
        self.checkpointed = committed_steps(self.gcs, self.prefix)[-1]
        before = host_pods(self.cp, self.namespace, self.cluster)
        victim = next(p for p in before if p["metadata"]["labels"][REPLICA_INDEX] == "1")
        self.cp.delete_node(victim["spec"]["nodeName"])  # a preemption: the virtual kubelet fails its pod
        self.deleted_at = time.time()
        wait_for(lambda: self.away_until(self.marker_dir), 600, "the slice's replacement node may come", interval=0.5)
        # Before the call: its nodes register (and Ray Train may grow onto them) while it is still returning.
        self.replaced_at = time.time()
        self.cp.add_node_pool(self.pool, tpu=V4, topology="2x2x2", num_nodes=1, host_processes=True)
        old = {p["metadata"]["uid"] for p in before}

        def recreated() -> list[dict[str, Any]] | None:
            pods = host_pods(self.cp, self.namespace, self.cluster)
            fresh = [p for p in pods if p["metadata"]["uid"] not in old]
            return pods if len(pods) == 4 and len(fresh) == 2 and all(map(pod_ready, pods)) else None

        self.pods_after = wait_for(recreated, 600, "slice 1 recreated by KubeRay, every host Ready", interval=1)


def test_losing_one_slice_of_two_resumes_from_the_checkpoint_with_fresh_slice_identities(
        airflow_home: Path, cp: ControlPlane, pool: str, cluster: str, namespace: str, gcs: FakeGcsServer,
        reference: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loss = SliceLoss(cp, namespace, cluster, pool, gcs, "multislice/lost/", tmp_path)
    loss.start()
    outcome: dict[str, TaskOutcome] = run_dag(
        airflow_home, train_dag("k8s_multislice_lost", cluster, f"gs://{BUCKET}/multislice/lost", tmp_path),
        "k8s_multislice_lost")
    loss.join(60)
    assert outcome["train"].state == "success", outcome
    result = outcome["train"].result
    resumed = result["resumed_from_step"]
    assert outcome["train"].try_number == 1, "the job survived: Ray Train restarted the worker group"
    assert resumed is not None and STEPS > resumed >= loss.checkpointed >= EVERY
    restarted = [r for r in records(tmp_path) if r["step"] == resumed + 1]
    back = max((r["time"] for r in restarted), default=float("nan"))
    reached = max(p["step"] for p in progress(tmp_path) if p["time"] < min(r["time"] for r in restarted))
    with capsys.disabled():
        print(f"\n[multi-slice] a node of slice 1 deleted with step {loss.checkpointed} committed; step {reached} "
              f"reached before the restart, resumed from step {resumed}: {reached - resumed} step(s) lost; all 4 "
              f"workers training again {back - loss.deleted_at:.1f} s after the deletion; loss difference to the "
              f"reference {abs(result['metrics']['loss'] - reference['result']['metrics']['loss']):.2e}")

    # KubeRay recreated slice 1 only, under the same index; the webhook gave its new hosts that slice's identity.
    survivors = {p["metadata"]["uid"] for p in reference["pods"] if p["metadata"]["labels"][REPLICA_INDEX] == "0"}
    assert {p["metadata"]["uid"] for p in loss.pods_after if p["metadata"]["labels"][REPLICA_INDEX] == "0"} == survivors
    addresses = assert_each_host_knows_its_slice(loss.pods_after, cluster)
    # Every worker of both slices started again at the step after the checkpoint, with fresh MEGASCALE_*.
    assert_workers_see_their_slices(restarted, addresses[("0", "0")])
    fresh_ips = {ip for (replica, _), ip in addresses.items() if replica == "1"}
    assert {r["node_ip"] for r in restarted if r["slice"] == f"{GROUP}-1"} == fresh_ips
    assert abs(result["metrics"]["loss"] - reference["result"]["metrics"]["loss"]) <= TOLERANCE
    # Ray keeps the lost hosts' raylets in its node list as DEAD; the cluster is READY as Ray sees it.
    status, body = dashboard_get(cp, namespace, cluster, "/api/v0/nodes?limit=100")
    assert status == 200 and [n["state"] for n in json.loads(body)["data"]["result"]["result"]].count("DEAD") >= 2
    ready = RayTpuHook().backend.cluster_status(cluster, namespace, confirm_with_ray=True)
    assert ready.phase is Phase.READY and ready.message.endswith("Ray lists 4 of 4 TPU hosts with their chips and "
                                                                  "slice, one slice head per slice"), ready.message


def trained_on_one_slice(gcs: FakeGcsServer, prefix: str) -> Callable[[Path], bool]:
    """Whether the workers of the slice left have started again and committed a checkpoint of their own.

    Until then the group that grows back would resume from the checkpoint the slice left resumed from,
    at the same step, and nothing would tell the two groups' training apart.
    """

    def trained(marker_dir: Path) -> bool:
        started = [r["step"] for r in records(marker_dir) if r["world_size"] == 2]
        committed = committed_steps(gcs, prefix)
        return bool(started and committed) and committed[-1] >= min(started)

    return trained


def test_elastic_slices_train_on_the_slice_left_and_grow_back(
        airflow_home: Path, cp: ControlPlane, pool: str, cluster: str, namespace: str, gcs: FakeGcsServer,
        reference: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loss = SliceLoss(cp, namespace, cluster, pool, gcs, "multislice/elastic/", tmp_path,
                     trained_on_one_slice(gcs, "multislice/elastic/"))
    loss.start()
    dag = train_dag("k8s_multislice_elastic", cluster, f"gs://{BUCKET}/multislice/elastic", tmp_path,
                    more="elastic_slices=(1, 2), resize_interval=2,", total_steps=ELASTIC_STEPS, checkpoint_every=50,
                    step_seconds=0.2)
    outcome = run_dag(airflow_home, dag, "k8s_multislice_elastic")
    loss.join(60)
    assert outcome["train"].state == "success", outcome
    assert outcome["train"].try_number == 1 and outcome["train"].result["steps"] == ELASTIC_STEPS
    seen = records(tmp_path)
    one = [r for r in seen if r["world_size"] == 2]
    grown = [r for r in seen if r["world_size"] == 4 and r["time"] > loss.replaced_at]
    steps = progress(tmp_path)
    shrunk_at, grown_at = min(r["time"] for r in one), min(r["time"] for r in grown)
    on_one = [p["step"] for p in steps if shrunk_at <= p["time"] <= grown_at]
    with capsys.disabled():
        print(f"\n[elastic] slice 1 lost with step {loss.checkpointed} committed; trained on one slice from step "
              f"{min(r['step'] for r in one)} for {grown_at - shrunk_at:.1f} s ({len(on_one)} steps), starting "
              f"{shrunk_at - loss.deleted_at:.1f} s after the loss; grew back to two slices at step "
              f"{min(r['step'] for r in grown)}, {grown_at - loss.replaced_at:.1f} s after the replacement node came")

    # The slice left trained alone: its two hosts, world size 2, and no MEGASCALE_* in the workers (libtpu
    # would wait for the lost slice), though their pods still have the webhook's.
    assert sorted(r["rank"] for r in one) == [0, 1] and {r["slice"] for r in one} == {f"{GROUP}-0"}
    assert all(r["megascale"] == {} and r["host_megascale"]["MEGASCALE_NUM_SLICES"] == "2" for r in one)
    assert len(on_one) >= 3
    # Then both slices again, with Ray Train's multi-slice environment.
    assert_workers_see_their_slices(grown, assert_each_host_knows_its_slice(loss.pods_after, cluster)[("0", "0")])
    assert min(r["step"] for r in grown) > min(r["step"] for r in one) > loss.checkpointed - 1
