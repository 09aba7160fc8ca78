"""Ready pods read against Ray's node list, and the GKE TPU webhook's variables read from the pods.

The pods are those KubeRay makes from our manifest (containers, ``google.com/tpu`` limits, labels);
the node lists have the shape Ray 2.60's State API answers ``GET /api/v0/nodes`` with (captured from
a real head: ``{"result": true, "msg": "", "data": {"result": {"total", "num_after_truncation",
"num_filtered", "result": [...], "partial_failure_warning", "warnings"}}}``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from airflow_provider_raytpu.backends.kuberay.pods import slim_pod
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import (
    RAY_UNCONFIRMED,
    TPU_WEBHOOK_MISSING,
    ClusterStatus,
    Phase,
    ReconcileFailureGrace,
    read_ray_cluster,
)
from airflow_provider_raytpu.status.ray_nodes import (
    RayAnswerError,
    check_ray_nodes,
    confirm_with_ray,
    read_nodes_answer,
    tpu_hosts,
)
from airflow_provider_raytpu.status.tpu_webhook import check_tpu_webhook, unmutated_pods
from airflow_provider_raytpu.tpu import TpuSlice

READY_CLUSTER_STATUS = {
    "conditions": [{"type": "HeadPodReady", "status": "True"}, {"type": "RayClusterProvisioned", "status": "True"}],
}


def cluster(tpu: TpuSlice) -> dict[str, Any]:
    manifest = build_ray_cluster(name="nightly", namespace="ml", tpu=tpu)
    group = manifest["spec"]["workerGroupSpecs"][0]
    manifest["status"] = {**READY_CLUSTER_STATUS, "desiredWorkerReplicas": tpu.total_hosts,
                          "readyWorkerReplicas": tpu.total_hosts}
    assert group["numOfHosts"] == tpu.hosts_per_slice
    return manifest


def pods(manifest: dict[str, Any], *, mutated: bool = True) -> list[dict[str, Any]]:
    """The pods KubeRay makes for the manifest's TPU group, as the API server returns them once ready; with
    ``mutated``, carrying what GKE's TPU webhook adds."""
    group = manifest["spec"]["workerGroupSpecs"][0]
    found = [{"metadata": {"name": "nightly-head", "labels": {"ray.io/node-type": "head", "ray.io/group": "headgroup"}},
              "spec": copy.deepcopy(manifest["spec"]["headGroupSpec"]["template"]["spec"]),
              "status": {"phase": "Running", "podIP": "10.8.0.2", "conditions": [{"type": "Ready", "status": "True"}]}}]
    for replica in range(group["replicas"]):
        for host in range(group["numOfHosts"]):
            spec = copy.deepcopy(group["template"]["spec"])
            if mutated:
                env = spec["containers"][0].setdefault("env", [])
                env += [{"name": "TPU_WORKER_ID", "value": str(host)},
                        {"name": "TPU_NAME", "value": f"{group['groupName']}-{replica}"}]
                if group["numOfHosts"] > 1:
                    env.append({"name": "TPU_WORKER_HOSTNAMES", "value": "a,b"})
            found.append({
                "metadata": {"name": f"nightly-tpu-{replica}-{host}", "labels": {
                    "ray.io/node-type": "worker", "ray.io/group": group["groupName"],
                    "ray.io/worker-group-replica-index": str(replica), "ray.io/replica-host-index": str(host)}},
                "spec": spec,
                "status": {"phase": "Running", "podIP": f"10.8.{replica + 1}.{host + 10}",
                           "conditions": [{"type": "Ready", "status": "True"}]},
            })
    return found


def ray_node(ip: str, resources: dict[str, float], labels: dict[str, str], head: bool = False) -> dict[str, Any]:
    return {"node_id": f"id-{ip}", "node_ip": ip, "is_head_node": head, "state": "ALIVE", "state_message": None,
            "node_name": ip, "resources_total": {"CPU": 1.0, f"node:{ip}": 1.0, **resources},
            "labels": {"ray.io/node-id": f"id-{ip}", **labels}}


def answer(nodes: list[dict[str, Any]], total: int | None = None) -> dict[str, Any]:
    total = len(nodes) if total is None else total
    return {"result": True, "msg": "", "data": {"result": {
        "total": total, "num_after_truncation": len(nodes), "num_filtered": len(nodes), "result": nodes,
        "partial_failure_warning": "", "warnings": None}}}


def ray_lists(tpu: TpuSlice, pod_list: list[dict[str, Any]], **overrides: dict[str, Any]) -> dict[str, Any]:
    """What Ray lists for these pods when every host registered as GKE's webhook and device plugin make it;
    ``overrides`` by pod name replace a node's resources/labels."""
    nodes = [ray_node("10.8.0.2", {"node:__internal_head__": 1.0}, {}, head=True)]
    for pod in pod_list[1:]:
        labels = pod["metadata"]["labels"]
        replica, host = labels["ray.io/worker-group-replica-index"], labels["ray.io/replica-host-index"]
        resources = {"TPU": float(tpu.host_chips), f"tpu-group-{replica}": 1.0,
                     **({tpu.head_resource: 1.0} if host == "0" else {})}
        node_labels = {"ray.io/tpu-slice-name": f"tpu-group-{replica}", "ray.io/tpu-worker-id": host,
                       "ray.io/tpu-topology": tpu.topology, "ray.io/tpu-pod-type": tpu.pod_type}
        change = overrides.get(pod["metadata"]["name"], {})
        nodes.append(ray_node(pod["status"]["podIP"], change.get("resources", resources),
                              change.get("labels", node_labels)))
    return answer(nodes)


V6E_TWO_SLICES = TpuSlice("v6e", "4x4", num_slices=2)


def ready(manifest: dict[str, Any], pod_list: list[dict[str, Any]]) -> ClusterStatus:
    status = read_ray_cluster(manifest, pod_list)
    assert status.phase is Phase.READY, status
    return status


def test_every_host_with_its_chips_slice_and_one_head_per_slice_is_ready() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    confirmed = confirm_with_ray(ready(manifest, pod_list), pod_list,
                                 read_nodes_answer(ray_lists(V6E_TWO_SLICES, pod_list)))
    assert confirmed.phase is Phase.READY
    assert confirmed.ray_hosts == 8
    assert confirmed.message.endswith("Ray lists 8 of 8 TPU hosts with their chips and slice, one slice head per slice")
    assert ClusterStatus.from_dict(confirmed.to_dict()) == confirmed


def test_a_host_without_tpu_chips_is_named_and_holds_the_cluster() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    no_tpu = {"resources": {"tpu-group-1": 1.0}, "labels": {"ray.io/tpu-slice-name": "tpu-group-1",
                                                            "ray.io/tpu-worker-id": "2"}}
    confirmed = confirm_with_ray(ready(manifest, pod_list), pod_list, read_nodes_answer(
        ray_lists(V6E_TWO_SLICES, pod_list, **{"nightly-tpu-1-2": no_tpu})))
    assert (confirmed.phase, confirmed.reason, confirmed.ray_hosts) == (Phase.PROVISIONING, RAY_UNCONFIRMED, 7)
    assert "no TPU chips registered by pod nightly-tpu-1-2 (slice tpu-group-1 worker 2) has TPU=0, its pod 4" \
        in confirmed.message


def test_hosts_without_a_slice_name_and_a_slice_without_its_head() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    unlabelled = {name: {"resources": {"TPU": 4.0}, "labels": {}}
                  for name in ("nightly-tpu-0-0", "nightly-tpu-0-1", "nightly-tpu-0-2", "nightly-tpu-0-3")}
    confirmed = confirm_with_ray(ready(manifest, pod_list), pod_list,
                                 read_nodes_answer(ray_lists(V6E_TWO_SLICES, pod_list, **unlabelled)))
    assert confirmed.phase is Phase.PROVISIONING and confirmed.ray_hosts == 4
    assert ("no ray.io/tpu-slice-name label on pod nightly-tpu-0-0, pod nightly-tpu-0-1, pod nightly-tpu-0-2, "
            "pod nightly-tpu-0-3 (TPU_NAME and TPU_WORKER_ID not set)") in confirmed.message
    assert "Ray's slices have 4 hosts, the pods' 4, 4" in confirmed.message

    headless = {"nightly-tpu-1-0": {"resources": {"TPU": 4.0}, "labels": {"ray.io/tpu-slice-name": "tpu-group-1"}}}
    confirmed = confirm_with_ray(ready(manifest, pod_list), pod_list,
                                 read_nodes_answer(ray_lists(V6E_TWO_SLICES, pod_list, **headless)))
    assert "one TPU-<pod type>-head per slice needed: tpu-group-1 has 0" in confirmed.message


def test_a_host_ray_does_not_list_and_a_stale_node_of_a_replaced_pod() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    listing = ray_lists(V6E_TWO_SLICES, pod_list)
    nodes = listing["data"]["result"]["result"]
    listing["data"]["result"]["result"] = [n for n in nodes if n["node_ip"] != "10.8.2.13"]
    confirmed = confirm_with_ray(ready(manifest, pod_list), pod_list, read_nodes_answer(listing))
    assert "Ray does not list 1 TPU host: pod nightly-tpu-1-3 (slice 1)" in confirmed.message
    assert "Ray's slices have 3, 4 hosts, the pods' 4, 4" in confirmed.message

    # The replaced host's raylet is still ALIVE in Ray (its health check has not failed yet): its IP is no pod's.
    stale = ray_node("10.8.2.99", {"TPU": 4.0, V6E_TWO_SLICES.head_resource: 1.0},
                     {"ray.io/tpu-slice-name": "tpu-group-1", "ray.io/tpu-worker-id": "0"})
    listing = ray_lists(V6E_TWO_SLICES, pod_list)
    listing["data"]["result"]["result"].append(stale)
    assert confirm_with_ray(ready(manifest, pod_list), pod_list, read_nodes_answer(listing)).phase is Phase.READY


def test_hosts_on_one_address_are_counted_per_slice() -> None:
    """The local backend's raylets share 127.0.0.1: nodes cannot be told apart by IP, only counted."""
    tpu = TpuSlice("v6e", "2x4", chips_per_host=4)
    manifest = cluster(tpu)
    pod_list = pods(manifest)
    for pod in pod_list:
        pod["status"]["podIP"] = "127.0.0.1"
    listing = ray_lists(tpu, pod_list)
    hosts = tpu_hosts(pod_list)
    assert check_ray_nodes(hosts, read_nodes_answer(listing)).problems == ()
    listing["data"]["result"]["result"].pop()
    check = check_ray_nodes(hosts, read_nodes_answer(listing))
    assert check.problems == ("Ray lists 1 of 2 TPU hosts", "Ray's slices have 1 hosts, the pods' 2")


def test_answers_that_are_not_a_whole_node_list() -> None:
    with pytest.raises(RayAnswerError, match="State API failed: boom"):
        read_nodes_answer({"result": False, "msg": "boom", "data": {}})
    with pytest.raises(RayAnswerError, match="listed 1 of 300 nodes"):
        read_nodes_answer(answer([ray_node("10.0.0.1", {}, {})], total=300))
    with pytest.raises(RayAnswerError, match="not a node list"):
        read_nodes_answer({"detail": "Not Found"})
    dead = ray_node("10.0.0.2", {"TPU": 4.0}, {})
    dead["state"] = "DEAD"
    assert read_nodes_answer(answer([dead])) == []


def test_a_cluster_without_tpu_hosts_needs_nothing_from_ray() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    head_only = pods(manifest)[:1]
    status = read_ray_cluster(manifest, head_only)
    assert confirm_with_ray(status, head_only, []).message == status.message


def test_ray_that_never_lists_the_hosts_fails_after_the_grace_period() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    unconfirmed = confirm_with_ray(ready(manifest, pod_list), pod_list, [])
    grace = ReconcileFailureGrace(600)
    assert grace.judge(unconfirmed, 1000.0).phase is Phase.PROVISIONING
    assert grace.seconds_left(unconfirmed, 1300.0) == 300
    failed = grace.judge(unconfirmed, 1601.0)
    assert failed.phase is Phase.FAILED
    assert failed.message.startswith("Ray has not listed its TPU hosts for 601 s, longer than the grace period "
                                     "of 600 s: head ready; 8 of 8 TPU hosts ready")
    assert "Ray does not list 8 TPU hosts: pod nightly-tpu-0-0 (slice 0)" in failed.message


@pytest.mark.parametrize(("tpu", "missing"), [
    (V6E_TWO_SLICES, "TPU_WORKER_ID or TPU_WORKER_HOSTNAMES"),
    (TpuSlice("v6e", "2x4"), "TPU_WORKER_ID"),
])
def test_tpu_pods_the_webhook_did_not_mutate_fail_at_once(tpu: TpuSlice, missing: str) -> None:
    manifest = cluster(tpu)
    assert unmutated_pods(manifest, pods(manifest)) == []
    bare = pods(manifest, mutated=False)
    status = check_tpu_webhook(read_ray_cluster(manifest, bare), manifest, bare)
    assert (status.phase, status.reason) == (Phase.FAILED, TPU_WEBHOOK_MISSING)
    assert status.message.startswith("the GKE TPU webhook did not mutate these pods: slice 0 (pod nightly-tpu-0-0)")
    assert f"have no {missing}, so Ray cannot group their hosts into slices" in status.message
    assert "kubectl get mutatingwebhookconfigurations" in status.message
    assert "--update-addons=RayOperator=ENABLED" in status.message
    # Pods whose containers are not known (the local backend's) are not judged.
    assert unmutated_pods(manifest, [{**p, "spec": {}} for p in bare]) == []


def test_the_informer_keeps_what_both_checks_read_and_no_variable_values() -> None:
    manifest = cluster(V6E_TWO_SLICES)
    pod_list = pods(manifest)
    pod_list[1]["spec"]["containers"][0]["env"].append({"name": "HF_TOKEN", "value": "s3cret"})
    slim = [slim_pod(copy.deepcopy(p)) for p in pod_list]
    assert "s3cret" not in repr(slim)
    assert tpu_hosts(slim) == tpu_hosts(pod_list)
    assert unmutated_pods(manifest, slim) == []
    assert unmutated_pods(manifest, [slim_pod(p) for p in pods(manifest, mutated=False)]) == [
        f"slice {r} (pod nightly-tpu-{r}-{h})" for r in range(2) for h in range(4)]
