"""The manifests this provider renders, field by field against KubeRay's own TPU samples.

The samples are read from KubeRay's Go module at the control plane's tag (``make kuberay-samples``:
``tests/controlplane/build_binaries.sh --samples``; v1.6.2, whose TPU samples differ from v1.7.0's only in how
``rayVersion`` is quoted). For each sample the same shape is rendered with the default options; what
must agree is compared; every intended difference is listed in :data:`INTENDED` with why, and checked
to be exactly that difference.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_provider_raytpu.manifests.raycluster import AGENT_PORTS, build_ray_cluster
from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.tpu import GENERATIONS, TpuSlice

BUILD = Path(__file__).resolve().parents[1] / "controlplane" / "build_binaries.sh"
LABELS = {g.gke_accelerator: g.name for g in GENERATIONS.values()}
CLUSTERS = ("ray-cluster.tpu-v4-singlehost.yaml", "ray-cluster.tpu-v4-multihost.yaml",
            "ray-cluster.tpu-v6e-singlehost.yaml", "ray-cluster.tpu-v6e-16-multihost.yaml",
            "ray-cluster.tpu-v6e-256-multihost.yaml")
SERVICES = ("ray-service.tpu-single-host.yaml", "ray-service.vllm-tpu-v6e-singlehost.yaml")

#: Where this provider renders something else than the samples, on purpose.
INTENDED = {
    "head port names": "the GCS port is 'gcs-server' (the name KubeRay gives it in the head Service it makes); "
                       "the samples' 'gcs'",
    "head ports not rendered": "'grpc' 8888 (Serve's gRPC proxy is not enabled), 'mxla' 8081 and 'slicebuilder' "
                               "8471 (the head holds no TPU chip)",
    "resources": "CPU and memory are 3/4 of the host's GKE machine type (ct6e-standard-4t: 135 of 180 vCPU, 540 "
                 "of 720 GB) so Ray sees the host's CPUs; the samples ask for a fixed 1-100 CPUs",
    "ephemeral-storage": "not requested: the node's disk is the pod's",
    "minReplicas/maxReplicas": "equal to replicas: a slice is made and released whole, never autoscaled",
    "image": "this provider's default Ray TPU image (rayproject/ray:2.60.0-py311-tpu); the samples' 2.52.0",
    "imagePullPolicy": "unset: Kubernetes' default for a tagged image is IfNotPresent, what the samples write",
    "tolerations": "google.com/tpu (and gke-spot on spot) tolerated explicitly, not only through GKE's admission",
    "head env": "the v4 samples' Grafana/Prometheus addresses belong to a monitoring setup",
    "head rayStartParams": "dashboard-host 0.0.0.0 (KubeRay's default, made explicit)",
    "rayStartParams": "fixed ports for the agents KubeRay leaves dynamic (AGENT_PORTS): a raylet aborts when an agent "
                      "slow to start has not written its port file within 15 s",
    "enableInTreeAutoscaling": "false, explicitly: slices are not autoscaled",
    "application": "a RayService sample's Serve config, runtime_env, volumes, secrets and service account are "
                   "its application's",
}


@pytest.fixture(scope="module")
def samples() -> Path:
    found = subprocess.run(["bash", str(BUILD), "--samples-dir"], capture_output=True, text=True)
    if found.returncode != 0:
        if os.environ.get("RAYTPU_REQUIRE_SAMPLES"):
            pytest.fail(f"KubeRay's samples are missing: {found.stderr.strip()} (make kuberay-samples)")
        pytest.skip("KubeRay's samples are not downloaded (make kuberay-samples)")
    return Path(found.stdout.strip())


def shape_of(spec: dict[str, Any]) -> TpuSlice:
    """The slice shape a sample's TPU worker group asks for (its chips per host where not the default)."""
    (group,) = spec["workerGroupSpecs"]
    pod = group["template"]["spec"]
    selector = pod["nodeSelector"]
    generation, topology = LABELS[selector["cloud.google.com/gke-tpu-accelerator"]], selector[
        "cloud.google.com/gke-tpu-topology"]
    chips = int(pod["containers"][0]["resources"]["limits"]["google.com/tpu"])
    default = TpuSlice(generation, topology).host_chips
    return TpuSlice(generation, topology, num_slices=group["replicas"], chips_per_host=None if chips == default
                    else chips)


def container(spec: dict[str, Any], group: str) -> dict[str, Any]:
    holder = spec["headGroupSpec"] if group == "head" else spec["workerGroupSpecs"][0]
    return holder["template"]["spec"]["containers"][0]


def ports(c: dict[str, Any]) -> dict[int, str]:
    return {p["containerPort"]: p["name"] for p in c.get("ports") or []}


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or []}


def compare(sample: dict[str, Any], ours: dict[str, Any], tpu: TpuSlice) -> None:
    """What must agree, and each intended difference exactly as :data:`INTENDED` explains it."""
    s_group, o_group = sample["workerGroupSpecs"][0], ours["workerGroupSpecs"][0]
    assert o_group["numOfHosts"] == s_group.get("numOfHosts", 1) == tpu.hosts_per_slice
    assert o_group["replicas"] == s_group["replicas"]
    assert (o_group["minReplicas"], o_group["maxReplicas"]) == (tpu.num_slices, tpu.num_slices), INTENDED[
        "minReplicas/maxReplicas"]
    assert s_group["rayStartParams"] == {} and o_group["rayStartParams"] == AGENT_PORTS, INTENDED["rayStartParams"]
    s_pod, o_pod = s_group["template"]["spec"], o_group["template"]["spec"]
    assert o_pod["nodeSelector"] == s_pod["nodeSelector"]
    s_worker, o_worker = container(sample, "worker"), container(ours, "worker")
    for kind in ("requests", "limits"):
        assert o_worker["resources"][kind]["google.com/tpu"] == s_worker["resources"][kind]["google.com/tpu"]
        machine = tpu.machine_type
        assert (o_worker["resources"][kind]["cpu"], o_worker["resources"][kind]["memory"]) == (
            str(int(machine.vcpus * 0.75)), f"{int(machine.memory_gb * 0.75)}G"), INTENDED["resources"]
        assert "ephemeral-storage" not in o_worker["resources"][kind], INTENDED["ephemeral-storage"]
    tpu_env = {k: v for k, v in env(s_worker).items() if k in ("NODE_IP", "VBAR_CONTROL_SERVICE_URL",
                                                                "JAX_PLATFORMS", "ENABLE_PJRT_COMPATIBILITY")}
    if tpu.accelerator == "v6e" and tpu.is_multi_host:
        assert env(o_worker) == tpu_env and ports(o_worker) == ports(s_worker) == {8081: "mxla"}
    else:  # the vLLM sample's JAX_PLATFORMS=tpu is its application's (a single host needs no runtime setting)
        assert env(o_worker) == {} and ports(o_worker) == {}
    assert {t["key"] for t in o_pod["tolerations"]} >= {"google.com/tpu"}, INTENDED["tolerations"]
    assert "imagePullPolicy" not in o_worker, INTENDED["imagePullPolicy"]
    s_head, o_head = ports(container(sample, "head")), ports(container(ours, "head"))
    shared = {8265: "dashboard", 10001: "client", 8000: "serve"}
    assert {p: s_head[p] for p in shared if p in s_head} == {p: o_head[p] for p in shared if p in s_head}
    if 6379 in s_head:
        assert (s_head[6379], o_head[6379]) == ("gcs", "gcs-server"), INTENDED["head port names"]
    assert not set(s_head) - set(shared) - {6379} & set(o_head), INTENDED["head ports not rendered"]
    assert set(s_head) - set(o_head) <= {8888, 8081, 8471}, INTENDED["head ports not rendered"]
    assert ours["enableInTreeAutoscaling"] is False, INTENDED["enableInTreeAutoscaling"]
    assert ours["headGroupSpec"]["rayStartParams"] == {"dashboard-host": "0.0.0.0", **AGENT_PORTS}, INTENDED[
        "head rayStartParams"]


@pytest.mark.parametrize("name", CLUSTERS)
def test_a_raycluster_renders_as_kuberays_tpu_sample(samples: Path, name: str) -> None:
    sample = yaml.safe_load((samples / name).read_text())
    tpu = shape_of(sample["spec"])
    ours = build_ray_cluster(name="sample", namespace="default", tpu=tpu)["spec"]
    compare(sample["spec"], ours, tpu)
    assert container(ours, "worker")["image"] == "rayproject/ray:2.60.0-py311-tpu", INTENDED["image"]


@pytest.mark.parametrize("name", SERVICES)
def test_a_rayservices_cluster_renders_as_kuberays_tpu_sample(samples: Path, name: str) -> None:
    sample = yaml.safe_load((samples / name).read_text())
    config = sample["spec"]["rayClusterConfig"]
    tpu = shape_of(config)
    app = {"name": "app", "import_path": "serving.model:build_app"}
    ours = build_ray_service(name="sample", namespace="default", tpu=tpu, applications=[app], version="v1")
    config["workerGroupSpecs"][0]["maxReplicas"] = config["workerGroupSpecs"][0]["replicas"]  # INTENDED
    compare(config, ours["spec"]["rayClusterConfig"], tpu)

