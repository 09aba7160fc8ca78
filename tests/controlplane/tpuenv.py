"""Stand-in for the environment GKE's TPU device plugin gives a container that was allocated TPU chips.

On GKE the kubelet asks the TPU device plugin to allocate ``google.com/tpu`` chips when it starts a
container, and the plugin answers with devices, mounts and environment variables, computed from the
node's labels (``cloud.google.com/gke-tpu-accelerator``, ``cloud.google.com/gke-tpu-topology``) and
its chip count. This module computes that environment the way ``InitEnvs`` does in
ai-on-gke/tpu-device-plugin (pkg/tpu/util/util.go: ``InitEnvs``, ``AcceleratorGen``,
``convertAcceleratorType``, ``addPodsliceOrSliceEnvs``, ``addSingleHostEnvs``), for the
generations this project uses. There are no devices to hand out here: JAX runs on the CPU.

Ray's own TPU detection (ray/_private/accelerators/tpu.py) reads ``TPU_ACCELERATOR_TYPE`` and
``TPU_TOPOLOGY`` from here, and ``TPU_NAME`` / ``TPU_WORKER_ID`` from the TPU webhook
(tests/controlplane/tpuwebhook.py), and derives the slice labels and the ``TPU-<pod type>-head`` resource.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Node label value -> the generation name the plugin uses (AcceleratorGen).
_LEGACY_ACCELERATOR = re.compile(r"^tpu-v(\d+[ep]?)(?:-lite)?-(?:slice|podslice|device)$")
_METRICS_PORTS = {1: "8431", 2: "8431,8432", 4: "8431,8432,8433,8434",
                  8: "8431,8432,8433,8434,8435,8436,8437,8438"}
_CHIPS_PER_DIM = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}  # getChipsPerDim


def accelerator_generation(accelerator: str) -> str:
    """``tpu-v4-podslice`` -> ``v4``, ``tpu-v5-lite-podslice`` -> ``v5litepod``, ``tpu-v6e-slice`` -> ``v6e``,
    ``tpu7x`` -> ``tpu7x`` (AcceleratorGen).

    :param accelerator: the node's ``cloud.google.com/gke-tpu-accelerator`` label.
    """
    if re.fullmatch(r"tpu\d+[a-z]?", accelerator):
        return accelerator
    match = _LEGACY_ACCELERATOR.match(accelerator)
    if not match:
        raise ValueError(f"not a GKE TPU accelerator label: {accelerator!r}")
    generation = match.group(1)
    if "-lite" in accelerator:
        generation = f"v{generation}lite"
        if "podslice" in accelerator:
            generation += "pod"
    else:
        generation = f"v{generation}"
    return generation


def _dims(topology: str) -> list[int]:
    dims = [int(d) for d in topology.split("x")]
    return dims + [1] if len(dims) == 2 else dims


def device_plugin_env(accelerator: str, topology: str, chips_per_node: int, requested_chips: int) -> dict[str, str]:
    """The variables the TPU device plugin adds to a container that requested ``requested_chips`` chips.

    :param accelerator: the node's ``cloud.google.com/gke-tpu-accelerator`` label.
    :param topology: the node's ``cloud.google.com/gke-tpu-topology`` label (the slice's shape).
    :param chips_per_node: the node's ``google.com/tpu`` capacity.
    :param requested_chips: the container's ``google.com/tpu`` limit.
    """
    generation = accelerator_generation(accelerator)
    dims = _dims(topology)
    chips = 1
    for dim in dims:
        chips *= dim
    cores_per_chip = 1 if ("lite" in generation or generation == "v6e") else 2
    env = {
        "TPU_SKIP_MDS_QUERY": "true",
        "TPU_RUNTIME_METRICS_PORTS": _METRICS_PORTS[chips_per_node],
        "TPU_TOPOLOGY": topology,
        "TPU_ACCELERATOR_TYPE": f"{generation}-{chips * cores_per_chip}",
    }
    if accelerator.endswith("slice") or "tpu7x" in accelerator:
        per_host = _CHIPS_PER_DIM[requested_chips]
        host_bounds = ",".join(str(dims[i] // per_host[i]) for i in range(3))
        cube = all(d >= 4 for d in dims)
        if generation in ("v5litepod", "v6e"):
            wrap = ",".join("true" if d == 16 else "false" for d in dims)
        else:
            wrap = ",".join(["true" if cube else "false"] * 3)
        env.update({
            "TPU_TOPOLOGY_ALT": "false", "ALT": "false",
            "TPU_TOPOLOGY_WRAP": wrap, "WRAP": wrap,
            "HOST_BOUNDS": host_bounds, "TPU_HOST_BOUNDS": host_bounds,
            "CHIPS_PER_HOST_BOUNDS": ",".join(map(str, per_host)),
            "TPU_CHIPS_PER_HOST_BOUNDS": ",".join(map(str, per_host)),
        })
    if chips_per_node == chips and generation != "tpu7x":  # a single-host slice
        env.update({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost"})
    return env


def container_tpu_env(node_labels: Mapping[str, str], node_chips: int,
                      container_limits: Mapping[str, str]) -> dict[str, str]:
    """The device plugin's variables for one container, or nothing if it requested no TPU chips.

    :param node_labels: the node's labels.
    :param node_chips: the node's ``google.com/tpu`` capacity.
    :param container_limits: the container's resource limits.
    """
    requested = int(str(container_limits.get("google.com/tpu", "0")) or 0)
    accelerator = node_labels.get("cloud.google.com/gke-tpu-accelerator")
    topology = node_labels.get("cloud.google.com/gke-tpu-topology")
    if requested <= 0 or not accelerator or not topology:
        return {}
    return device_plugin_env(accelerator, topology, node_chips, requested)
