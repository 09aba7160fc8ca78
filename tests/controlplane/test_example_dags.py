"""The example DAGs on the real operator, unchanged but for the connection, with a real Ray process behind every pod.

``nightly_embeddings`` and ``nightly_finetune`` (example_dags/) run with ``dag.test()`` against the
session's control plane through a ``raytpu`` connection of backend ``kubernetes``, and the demo's fake
GCS. Every pod the real KubeRay operator makes runs here for real, in a network namespace of its own
(tests/controlplane/podnet.py): the head's ``ray start --head``, and on every TPU host a raylet that waits for
the head's GCS (KubeRay's ``wait-gcs-ready`` init container) and joins it through the head Service's
name, with the TPU environment GKE's device plugin and TPU webhook give (tests/controlplane/tpuenv.py,
tests/controlplane/tpuwebhook.py). Ray's own TPU detection makes the ``TPU`` resource (KubeRay renders it from
``google.com/tpu``), the slice labels and the ``TPU-v4-16-head`` resource from that environment. JAX
runs on the CPU.

In file order, on one namespace:

1. ``nightly_embeddings`` on a spot v4 2x2x2 slice (2 hosts): one embedding actor per TPU host,
   parquet in GCS, the cluster deleted as a teardown, no pod left.
2. ``nightly_finetune``, first run: v4 2x2x2 slice, preprocess, train 30 steps with orbax checkpoints
   in GCS, the RayService (a v6e 2x2 host) made and serving that checkpoint (v1); the training
   cluster is torn down. This run is the reference for the next one.
3. ``nightly_finetune``, second run: once a checkpoint at step 10 or later is committed, the Node of
   TPU host 1 is deleted (a preemption), and a replacement node joins its pool; KubeRay recreates the
   slice, the raylets rejoin, Ray Train resumes from the newest checkpoint and ends on the reference's
   loss within 1e-6. Then the RayService is promoted to the new checkpoint (v2) through KubeRay's
   NewCluster upgrade (a second real serving cluster) while a request loop goes through the API
   server's service proxy: no request fails and the answers switch from v1 to v2, once.
4. Deleting the RayService leaves no pod, and no pod network behind.

Needs pod networks (CAP_NET_ADMIN): without, the module skips (single-head mode, test_ray_head.py).

Running a DAG and reading what it left: example_runs.py; the preempted host: preemption.py; the
requests during the promotion: request_loop.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from example_dags.demo.fake_gcs import FakeGcsServer
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.example_runs import (
    BUCKET,
    LINEAGE_EVENTS,
    ROWS,
    V4,
    V6E,
    cluster_pods,
    committed_steps,
    conf,
    ran_for_real,
    run_example,
)
from tests.controlplane.preemption import Preemption
from tests.controlplane.request_loop import RequestLoop
from tests.controlplane.support import NodePools, ray_namespace, states, wait_for, wait_no_pods
from tests.support.airflow_runner import TaskOutcome
from tests.support.lineage import completed, datasets

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(1800)]

SERVICE = "finetuned-regressor"  # the service nightly_finetune promotes
INPUTS = {"inputs": [[0.5, -0.2, 0.1, 0.3, 0.0, 0.2, -0.1, 0.4]]}
TOLERANCE = 1e-6


@dataclass
class Pools:
    heads: str
    v4_spot: str
    v4: str
    v6e: str


@pytest.fixture(scope="module")
def cp(networked_control_plane: ControlPlane) -> ControlPlane:
    return networked_control_plane


@pytest.fixture(scope="module")
def pools(cp: ControlPlane, module_node_pools: NodePools) -> Pools:
    """Host-process node pools: one CPU node for the heads (room for three), a spot and an on-demand
    v4 2x2x2 slice, and two v6e 2x2 hosts (serving clusters v1 and v2 side by side)."""
    return Pools(
        heads=module_node_pools.add("heads", cpu_nodes=1, host_processes=True).name,
        v4_spot=module_node_pools.add("v4-spot", tpu=V4, topology="2x2x2", spot=True, host_processes=True).name,
        v4=module_node_pools.add("v4", tpu=V4, topology="2x2x2", host_processes=True).name,
        v6e=module_node_pools.add("v6e", tpu=V6E, topology="2x2", num_nodes=2, host_processes=True).name,
    )


@pytest.fixture(scope="module")
def namespace(cp: ControlPlane) -> Iterator[str]:
    """One namespace for the module (the RayService lives from the first finetune run to the last test)."""
    with ray_namespace(cp, "example-dags") as ns:
        yield ns


def reports_in(gcs: FakeGcsServer) -> int:
    """How many runs of nightly_finetune wrote both report files next to the checkpoints."""
    names = gcs.list_objects(BUCKET, "reports/nightly_finetune/")
    folders = {n.rsplit("/", 1)[0] for n in names}
    assert {f"{folder}/run_report.{ext}" for folder in folders for ext in ("json", "png")} == set(names), names
    return len(folders)


# -- 1. nightly_embeddings ----------------------------------------------------------------------


def test_nightly_embeddings_on_a_spot_slice_with_a_raylet_per_host(
        airflow_home: Path, cp: ControlPlane, pools: Pools, gcs: FakeGcsServer, namespace: str) -> None:
    outcome = run_example(airflow_home, "nightly_embeddings", conf(gcs, capacity="spot"), day=1)

    assert set(states(outcome).values()) == {"success"}, outcome
    cluster = outcome["create_cluster"].result["cluster_name"]
    embed = outcome["embed"].result
    assert (embed["rows_in"], embed["rows_out"]) == (ROWS, ROWS)
    assert embed["output_uri"] == f"gs://{BUCKET}/embeddings/2026-12-01"
    assert any(n.endswith(".parquet") for n in gcs.list_objects(BUCKET, "embeddings/2026-12-01/"))
    # Its lineage, as the OpenLineage provider's listener emitted it: the raw rows in, the embeddings out.
    event = completed(LINEAGE_EVENTS, "nightly_embeddings")["embed"]
    assert datasets(event, "inputs") == [(f"gs://{BUCKET}", "raw/rows.jsonl")]
    assert datasets(event, "outputs") == [(f"gs://{BUCKET}", "embeddings/2026-12-01")]
    assert event["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"] == ROWS
    # The head and both TPU hosts ran here and became Ready; their nodes are the spot pool's.
    assert len(ran_for_real(cp, namespace, cluster)) == 3
    wait_for(lambda: not cluster_pods(cp, namespace, cluster), 120, f"no pod of {cluster} left")


# -- 2. nightly_finetune, first run: the reference, and the service's v1 ------------------------


@pytest.fixture(scope="module")
def first_run(airflow_home: Path, cp: ControlPlane, pools: Pools, gcs: FakeGcsServer,
              namespace: str) -> dict[str, TaskOutcome]:
    return run_example(airflow_home, "nightly_finetune", conf(gcs), day=2)


def test_nightly_finetune_trains_checkpoints_and_serves_it(
        cp: ControlPlane, first_run: dict[str, TaskOutcome], gcs: FakeGcsServer, namespace: str) -> None:
    assert set(states(first_run).values()) == {"success"}, first_run
    train = first_run["train"].result
    assert train["steps"] == 30 and train["resumed_from_step"] is None
    assert train["metrics"]["eval_rows"] == ROWS
    assert train["checkpoint_uri"].startswith(f"gs://{BUCKET}/checkpoints/{train['run_name']}/")
    assert committed_steps(gcs, f"checkpoints/{train['run_name']}/")[-1] == 30
    serving = first_run["wait_serving"].result
    assert (serving["phase"], serving["active_version"]) == ("RUNNING", train["checkpoint_uri"])
    assert serving["smoke"]["status"] == 200 and serving["smoke"]["json"]["version"] == train["checkpoint_uri"]
    cluster = first_run["create_cluster"].result["cluster_name"]
    assert len(ran_for_real(cp, namespace, cluster)) == 3
    totals = first_run["run_report"].result["totals"]
    assert (totals["clusters"], totals["preemptions"], totals["steps_trained"], totals["steps_lost"]) == (1, 0, 30, 0)
    assert reports_in(gcs) == 1
    wait_for(lambda: not cluster_pods(cp, namespace, cluster), 120, f"no pod of {cluster} left")


# -- 3. nightly_finetune, second run: a preempted host, then promotion under load -----------------


def test_preempted_host_resumes_and_promotion_to_v2_fails_no_request(
        airflow_home: Path, cp: ControlPlane, pools: Pools, first_run: dict[str, TaskOutcome], gcs: FakeGcsServer,
        namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    reference = first_run["train"].result
    v1 = reference["checkpoint_uri"]
    serve = RayTpuHook().backend.services.serve_endpoint(SERVICE, namespace)
    preemption = Preemption(cp, namespace, gcs, pools.v4, reference["run_name"])
    preemption.start()
    with RequestLoop(lambda: serve.request("POST", "/", json=INPUTS, timeout=30)) as requests:
        second = run_example(airflow_home, "nightly_finetune", conf(gcs), day=3)
        time.sleep(2)  # a few more answers after the sensor saw v2 serving
    preemption.join(60)

    assert set(states(second).values()) == {"success"}, second
    train = second["train"].result
    v2 = train["checkpoint_uri"]
    with capsys.disabled():
        print(f"\n[preemption] node {preemption.deleted_node} deleted with step {preemption.checkpointed} committed; "
              f"resumed from step {train['resumed_from_step']}; train try {second['train'].try_number}\n"
              f"[promotion] {len(requests.versions) + len(requests.failures)} requests through the API server's "
              f"service proxy, {len(requests.failures)} failed; "
              f"{requests.versions.count(v1)} answered v1, {requests.versions.count(v2)} answered v2")

    # The preempted slice: KubeRay recreated both hosts, Ray's TPU detection named them as before.
    def tpu_hosts(nodes: list[dict[str, Any]]) -> list[tuple[str, str, float, float, str]]:
        return sorted((n["labels"]["ray.io/tpu-slice-name"], n["labels"]["ray.io/tpu-worker-id"],
                       n["resources_total"].get("TPU"), n["resources_total"].get("TPU-v4-16-head", 0.0),
                       n["labels"]["ray.io/tpu-pod-type"]) for n in nodes if "TPU" in n["resources_total"])

    expected = [("tpu-slices-0", "0", 4.0, 1.0, "v4-16"), ("tpu-slices-0", "1", 4.0, 0.0, "v4-16")]
    assert tpu_hosts(preemption.nodes_before) == expected
    assert tpu_hosts(preemption.nodes_after) == expected
    for nodes in (preemption.nodes_before, preemption.nodes_after):
        assert len({n["node_ip"] for n in nodes}) == 3, "every pod its own address"
        for node in nodes:
            if "TPU" in node["resources_total"]:
                assert node["labels"]["ray.io/tpu-topology"] == "2x2x2"
                assert node["resources_total"]["accelerator_type:TPU-V4"] == 1.0
                assert node["resources_total"]["tpu-slices-0"] == 1.0
    assert {n["node_id"] for n in preemption.nodes_after if "TPU" in n["resources_total"]}.isdisjoint(
        n["node_id"] for n in preemption.nodes_before)
    # Training resumed from the newest checkpoint and ended where the uninterrupted run did.
    assert train["steps"] == 30
    assert train["resumed_from_step"] is not None and train["resumed_from_step"] >= preemption.checkpointed >= 10
    for metric in ("loss", "holdout_loss", "eval_loss"):
        assert abs(train["metrics"][metric] - reference["metrics"][metric]) <= TOLERANCE, metric
    # Promotion v1 -> v2 through a second serving cluster, under load: nothing failed, one switch.
    serving = second["wait_serving"].result
    assert (serving["phase"], serving["active_version"]) == ("RUNNING", v2)
    assert serving["active_cluster"] != first_run["wait_serving"].result["active_cluster"]
    assert requests.failures == []
    assert requests.versions[0] == v1 and requests.versions[-1] == v2
    switched = requests.versions.index(v2)
    assert set(requests.versions[switched:]) == {v2}, "once v2 answers, v1 never answers again"
    cluster = second["create_cluster"].result["cluster_name"]
    wait_for(lambda: not cluster_pods(cp, namespace, cluster), 120, f"no pod of {cluster} left")
    # The training task counted its restart (the job's result is unchanged); the run report counts the slice
    # KubeRay made again, the 30 steps this run advanced and the steps the restart lost.
    attempts = second["train"].xcoms["training_attempts"]
    assert (attempts["attempts"], attempts["restarts"], attempts["started_at_step"]) == (2, 1, 0)
    (restart,) = attempts["lost"]
    assert restart["resumed_from"] == train["resumed_from_step"] and restart["reached"] >= restart["resumed_from"]
    assert attempts["steps_lost"] == restart["reached"] - restart["resumed_from"]
    report = second["run_report"].result
    assert report["clusters"] == second["delete_cluster"].xcoms["tpu_usage"]
    assert report["totals"]["preemptions"] == 1 and report["clusters"][0]["slices"][0]["made_again_at"]
    assert (report["totals"]["steps_trained"], report["totals"]["restarts"]) == (30, 1)
    assert report["totals"]["steps_lost"] == attempts["steps_lost"]
    assert reports_in(gcs) == 2


# -- 4. the end ----------------------------------------------------------------------------------


def test_deleting_the_service_leaves_no_pod_and_no_pod_network(cp: ControlPlane, first_run: dict[str, TaskOutcome],
                                                              namespace: str) -> None:
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    RayTpuHook().backend.services.delete_service(SERVICE, namespace)
    wait_no_pods(cp, namespace, timeout=180)
    assert cp.pod_network is not None
    wait_for(lambda: not cp.pod_network.namespaces(), 60, "every pod network namespace removed")
