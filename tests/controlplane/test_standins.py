"""The harness's stand-ins for GKE, against their sources' documented behaviour (no control plane needed).

The TPU webhook's patches for pods shaped like KubeRay 1.5 makes them (multi-host with its index
labels, single-host without), the TPU device plugin's environment, the cluster DNS names from
EndpointSlices, and the kubelet's ``$(VAR)`` expansion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.controlplane.clusterdns import dns_records
from tests.controlplane.hostpods import cap_cpus, expand, own_temp_dir
from tests.controlplane.tpuenv import accelerator_generation, device_plugin_env
from tests.controlplane.tpuwebhook import check_name, legacy_indices, pod_patches


def kuberay_worker(*, replica: int | None, host: int | None, topology: str = "2x2x2", chips: int = 4,
                   env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "kuberay", "ray.io/cluster": "rc", "ray.io/group": "tpu-slices",
              "ray.io/node-type": "worker"}
    if replica is not None:
        labels["ray.io/worker-group-replica-index"] = str(replica)
    if host is not None:
        labels["ray.io/replica-host-index"] = str(host)
    return {
        "metadata": {"generateName": "rc-tpu-slices-worker-", "labels": labels},
        "spec": {
            "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v4-podslice",
                             "cloud.google.com/gke-tpu-topology": topology},
            "containers": [{"name": "ray-worker", "env": env or [{"name": "RAY_PORT", "value": "6379"}],
                            "resources": {"limits": {"google.com/tpu": str(chips)},
                                          "requests": {"google.com/tpu": str(chips)}}}],
        },
    }


def added_env(patches: list[dict[str, Any]]) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for patch in patches:
        if "/env" in patch["path"]:
            for var in patch["value"] if isinstance(patch["value"], list) else [patch["value"]]:
                env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def no_pods(namespace: str, cluster: str, group: str) -> list[dict[str, Any]]:
    raise AssertionError("the indexing labels are there: the webhook lists no pods")


def test_the_webhook_gives_a_multi_host_pod_its_slice_identity_from_kuberays_labels() -> None:
    patches = pod_patches(kuberay_worker(replica=1, host=1), "ns", no_pods)

    assert {p["path"]: p["value"] for p in patches if "/env" not in p["path"]} == {
        "/spec/hostname": "tpu-slices-1-1", "/spec/subdomain": "rc-headless"}
    assert added_env(patches) == {
        "TPU_WORKER_HOSTNAMES": "tpu-slices-1-0.rc-headless,tpu-slices-1-1.rc-headless",
        "TPU_WORKER_ID": "1",
        "TPU_NAME": "tpu-slices-1",
        "TPU_DEVICE_PLUGIN_HOST_IP": {"fieldRef": {"fieldPath": "status.hostIP"}},
        "TPU_DEVICE_PLUGIN_ADDR": "$(TPU_DEVICE_PLUGIN_HOST_IP):2112",
    }
    assert all(p["path"] == "/spec/containers/0/env/-" for p in patches if "/env" in p["path"])


def test_the_webhook_sets_megascale_only_when_the_pod_asks_for_slices() -> None:
    pod = kuberay_worker(replica=1, host=0, env=[{"name": "MEGASCALE_NUM_SLICES", "value": "2"}])
    env = added_env(pod_patches(pod, "ns", no_pods))
    assert (env["MEGASCALE_SLICE_ID"], env["MEGASCALE_COORDINATOR_ADDRESS"], env["MEGASCALE_PORT"]) == (
        "1", "tpu-slices-0-0.rc-headless", "8081")
    assert "MEGASCALE_SLICE_ID" not in added_env(pod_patches(kuberay_worker(replica=1, host=0), "ns", no_pods))


def test_the_webhook_indexes_single_host_slices_the_legacy_way_and_leaves_other_pods_alone() -> None:
    existing = kuberay_worker(replica=0, host=None, topology="2x2x1",
                              env=[{"name": "TPU_WORKER_ID", "value": "0"}])
    existing["metadata"]["labels"]["replicaIndex"] = "tpu-slices-0"
    patches = pod_patches(kuberay_worker(replica=1, host=None, topology="2x2x1"), "ns",
                          lambda ns, cluster, group: [existing])

    assert {"op": "add", "path": "/metadata/labels/replicaIndex", "value": "tpu-slices-1"} in patches
    assert not any(p["path"].startswith("/spec/host") for p in patches), "one host: no DNS names"
    assert (added_env(patches)["TPU_WORKER_ID"], added_env(patches)["TPU_NAME"]) == ("0", "tpu-slices-1")
    head = {"metadata": {"labels": {"ray.io/cluster": "rc"}}, "spec": {"containers": [{"name": "ray-head"}]}}
    assert pod_patches(head, "ns", no_pods) == []


def test_legacy_indices_fill_the_lowest_free_host_then_open_a_replica() -> None:
    def pod(replica: int, worker: int, deleting: bool = False) -> dict[str, Any]:
        made = kuberay_worker(replica=None, host=None, env=[{"name": "TPU_WORKER_ID", "value": str(worker)}])
        made["metadata"]["labels"]["replicaIndex"] = f"tpu-slices-{replica}"
        if deleting:
            made["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
        return made

    assert legacy_indices([], "tpu-slices", 2) == (0, 0)
    assert legacy_indices([pod(0, 1)], "tpu-slices", 2) == (0, 0)
    assert legacy_indices([pod(0, 0), pod(0, 1)], "tpu-slices", 2) == (1, 0)
    assert legacy_indices([pod(0, 0), pod(0, 1, deleting=True)], "tpu-slices", 2) == (0, 1)


def test_the_webhook_refuses_a_tpu_pod_without_a_topology_selector() -> None:
    pod = kuberay_worker(replica=0, host=0)
    del pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    with pytest.raises(ValueError, match="missing TPU topology nodeSelector"):
        pod_patches(pod, "ns", no_pods)


def test_kuberay_name_shortening() -> None:
    assert check_name("rc-headless") == "rc-headless"
    assert check_name("x" * 60 + "-headless") == "x" * 41 + "-headless"
    assert check_name("1abc") == "rabc"


def test_the_device_plugin_environment_of_a_v4_and_a_v6e_host() -> None:
    assert device_plugin_env("tpu-v4-podslice", "2x2x2", chips_per_node=4, requested_chips=4) == {
        "TPU_SKIP_MDS_QUERY": "true", "TPU_RUNTIME_METRICS_PORTS": "8431,8432,8433,8434",
        "TPU_TOPOLOGY": "2x2x2", "TPU_ACCELERATOR_TYPE": "v4-16",
        "TPU_TOPOLOGY_ALT": "false", "ALT": "false", "TPU_TOPOLOGY_WRAP": "false,false,false",
        "WRAP": "false,false,false", "HOST_BOUNDS": "1,1,2", "TPU_HOST_BOUNDS": "1,1,2",
        "CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    }
    single = device_plugin_env("tpu-v6e-slice", "2x2", chips_per_node=4, requested_chips=4)
    assert (single["TPU_ACCELERATOR_TYPE"], single["TPU_WORKER_ID"], single["TPU_WORKER_HOSTNAMES"]) == (
        "v6e-4", "0", "localhost")
    assert device_plugin_env("tpu-v5p-slice", "4x4x4", 4, 4)["TPU_TOPOLOGY_WRAP"] == "true,true,true"
    assert [accelerator_generation(a) for a in ("tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu7x")] == [
        "v5litepod", "v5p", "tpu7x"]


def test_cluster_dns_names_from_endpoint_slices() -> None:
    def endpoint_slice(service: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": service}},
                "addressType": "IPv4", "endpoints": list(endpoints)}

    records = dns_records([
        endpoint_slice("rc-head-svc", {"addresses": ["10.240.1.5"], "conditions": {"ready": True}}),
        endpoint_slice("rc-headless", {"addresses": ["10.240.1.7"], "hostname": "tpu-slices-0-1"},
                       {"addresses": ["10.240.1.6"], "hostname": "tpu-slices-0-0"}),
        endpoint_slice("gone", {"addresses": ["10.240.1.9"], "conditions": {"ready": False}}),
    ])
    assert records[""]["rc-head-svc.ns.svc.cluster.local"] == "10.240.1.5"
    assert records["ns"]["rc-head-svc"] == "10.240.1.5"
    assert records[""]["tpu-slices-0-1.rc-headless.ns.svc.cluster.local"] == "10.240.1.7"
    assert records["ns"]["tpu-slices-0-0.rc-headless"] == "10.240.1.6"
    assert not any("gone" in name for names in records.values() for name in names)


def test_kubelet_expansion_and_the_cpu_cap() -> None:
    assert expand("$(HOST):2112 $$(HOST) $(UNKNOWN)", {"HOST": "10.128.0.3"}) == "10.128.0.3:2112 $(HOST) $(UNKNOWN)"
    assert cap_cpus(["ray start  --num-cpus=240  --resources='{\"TPU\":4}'"]) == [
        "ray start  --num-cpus=1  --resources='{\"TPU\":4}'"]
    assert cap_cpus(["ray start --num-cpus=0"]) == ["ray start --num-cpus=0"]


def test_a_worker_keeps_its_ray_files_in_its_own_directory() -> None:
    pod_tmp = Path("/tmp/rtpu/ab12")
    worker = "ulimit -n 65536; ray start  --address=rc-head-svc.ns.svc.cluster.local:6379  --block"
    assert own_temp_dir(["/bin/bash", "-lc", worker], pod_tmp) == ["/bin/bash", "-lc", worker.replace(
        "ray start ", "ray start --temp-dir=/tmp/rtpu/ab12 ")]
    head = "ulimit -n 65536; ray start --head --block"  # a head's own temp dir comes from RAY_TMPDIR
    assert own_temp_dir(["/bin/bash", "-lc", head], pod_tmp) == ["/bin/bash", "-lc", head]
    assert own_temp_dir(["ray", "health-check", "--address=rc-head-svc:6379"], pod_tmp) == [
        "ray", "health-check", "--address=rc-head-svc:6379"]
