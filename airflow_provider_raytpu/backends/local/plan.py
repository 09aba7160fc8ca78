"""A RayCluster manifest read as local Ray nodes: a head plus one raylet per TPU host.

Pure: no processes, no files. :func:`plan_cluster` checks the manifest's TPU worker group
against its slice annotation and gives every host the TPU resources, node labels and
``TPU_*`` environment a GKE TPU host gets, so Ray's own TPU placement works on the
emulated slice. Of the manifest's ``rayStartParams`` only ``num-cpus`` (capped at 1, to
keep the machine usable) and ``resources`` are honoured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import MXLA_PORT, NUM_SLICES_ENV, tpu_slice_of
from airflow_provider_raytpu.tpu import TPU_RESOURCE, TpuSlice

HEAD_MAX_CPUS = 1
HOST_MAX_CPUS = 1

LABEL_SLICE_NAME = "ray.io/tpu-slice-name"
LABEL_WORKER_ID = "ray.io/tpu-worker-id"
LABEL_TOPOLOGY = "ray.io/tpu-topology"
LABEL_POD_TYPE = "ray.io/tpu-pod-type"
LABEL_ACCELERATOR_TYPE = "ray.io/accelerator-type"


@dataclass(frozen=True)
class NodeSpec:
    """One local Ray node: the head or one TPU host.

    :param key: ``head`` or ``s<slice>h<host>``; names its log and temp dir.
    :param num_cpus: ``--num-cpus``.
    :param resources: custom resources (``--resources``).
    :param labels: node labels (``--labels``).
    :param env: environment added to the node's processes.
    :param slice_index: the slice (replica index) of a TPU host.
    :param worker_id: the host's index within its slice (``TPU_WORKER_ID``).
    """

    key: str
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    slice_index: int | None = None
    worker_id: int | None = None


@dataclass(frozen=True)
class LocalPlan:
    """A RayCluster manifest interpreted for this machine.

    :param name: the cluster name.
    :param namespace: its namespace.
    :param tpu: the slice shape from the manifest's annotation.
    :param group_name: the TPU worker group's name.
    :param head: the head node.
    :param slices: per slice, its hosts in worker-id order.
    :param slice_names: the slice names (``TPU_NAME``), ``<cluster>-slice-<i>``.
    :param suspended: ``spec.suspend``; nothing is started.
    """

    name: str
    namespace: str
    tpu: TpuSlice
    group_name: str
    head: NodeSpec
    slices: tuple[tuple[NodeSpec, ...], ...]
    slice_names: tuple[str, ...]
    suspended: bool = False

    @property
    def total_hosts(self) -> int:
        return sum(len(hosts) for hosts in self.slices)


def slice_name(cluster_name: str, index: int) -> str:
    """The name of slice ``index`` of a cluster (its ``TPU_NAME`` and Ray resource)."""
    return f"{cluster_name}-slice-{index}"


def parse_cpu(value: Any) -> float:
    """A Kubernetes CPU quantity (``2``, ``"500m"``, ``"1.5"``) in cores."""
    text = str(value).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise InvalidInputError("cpu", value, "is not a Kubernetes CPU quantity", "Write e.g. '2' or '500m'") from None


def _ray_param_resources(params: Mapping[str, Any], where: str) -> dict[str, float]:
    text = str(params.get("resources") or "").strip()
    if not text:
        return {}
    while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    try:
        resources = json.loads(text.replace('\\"', '"'))
        if not isinstance(resources, dict):
            raise ValueError
        return {str(k): float(v) for k, v in resources.items()}
    except (ValueError, TypeError):
        raise InvalidInputError(
            f"{where}.rayStartParams.resources", params.get("resources"), "is not a JSON object of resources",
            'Write e.g. \'"{\\"my-resource\\": 1}"\'',
        ) from None


def _container(template: Mapping[str, Any], resource: str | None = None) -> dict[str, Any]:
    containers: list[dict[str, Any]] = (template.get("spec") or {}).get("containers") or [{}]
    if resource:
        for container in containers:
            if resource in ((container.get("resources") or {}).get("limits") or {}):
                return container
    return containers[0]


def _megascale_env(env: Mapping[str, str], slice_index: int) -> dict[str, str]:
    """What GKE's TPU webhook adds to a host whose container sets ``MEGASCALE_NUM_SLICES``: its slice's id,
    the coordinator (host 0 of slice 0: here, like every host, at 127.0.0.1) and the DCN port."""
    if NUM_SLICES_ENV not in env:
        return {}
    return {"MEGASCALE_SLICE_ID": str(slice_index), "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1",
            "MEGASCALE_PORT": str(MXLA_PORT["containerPort"])}


def _container_env(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env") or [] if "name" in e and "value" in e}


def _num_cpus(params: Mapping[str, Any], container: Mapping[str, Any], cap: int) -> int:
    if "num-cpus" in params:
        wanted = parse_cpu(params["num-cpus"])
    else:
        limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
        wanted = parse_cpu(limit) if limit is not None else cap
    return max(0, min(cap, math.ceil(wanted)))


def plan_cluster(manifest: Mapping[str, Any], max_hosts: int | None = None) -> LocalPlan:
    """Interpret a RayCluster manifest (from ``build_ray_cluster``) as local Ray nodes.

    The slice shape comes from the manifest's TPU slice annotation and is cross-checked
    against the TPU worker group (replicas, numOfHosts, the ``google.com/tpu`` limit).

    :param manifest: the RayCluster.
    :param max_hosts: refuse clusters with more TPU hosts than this (``replicas x numOfHosts``).
    :raises InvalidInputError: the manifest cannot be emulated here; nothing was started.
    """
    name, namespace = _cluster_identity(manifest)
    tpu = _slice_shape(manifest, name)
    spec = manifest.get("spec") or {}
    group = _tpu_worker_group(spec)
    worker = _container(group.get("template") or {}, TPU_RESOURCE)
    _check_group_matches_slice(group, worker, tpu)
    _check_host_count(tpu, max_hosts)
    names = tuple(slice_name(name, i) for i in range(tpu.num_slices))
    host = _TpuHostTemplate(
        tpu=tpu,
        num_cpus=_num_cpus(group.get("rayStartParams") or {}, worker, HOST_MAX_CPUS),
        extra_resources=_ray_param_resources(group.get("rayStartParams") or {}, "workerGroupSpecs[0]"),
        env=_container_env(worker),
    )
    return LocalPlan(
        name=name,
        namespace=namespace,
        tpu=tpu,
        group_name=str(group.get("groupName") or "workers"),
        head=_head_node(spec.get("headGroupSpec") or {}),
        slices=tuple(tuple(host.node(index, slice_, worker_id) for worker_id in range(tpu.hosts_per_slice))
                     for index, slice_ in enumerate(names)),
        slice_names=names,
        suspended=bool(spec.get("suspend")),
    )


def _cluster_identity(manifest: Mapping[str, Any]) -> tuple[str, str]:
    metadata = manifest.get("metadata") or {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not name or not namespace:
        raise InvalidInputError("manifest.metadata", metadata, "lacks a name or namespace",
                                "Render the RayCluster with build_ray_cluster")
    return str(name), str(namespace)


def _slice_shape(manifest: Mapping[str, Any], name: str) -> TpuSlice:
    tpu = tpu_slice_of(manifest)
    if tpu is None:
        raise InvalidInputError(
            "manifest", name, "has no TPU slice annotation, so the local backend cannot tell the slice shape",
            "Render the RayCluster with build_ray_cluster(tpu=TpuSlice(...))",
        )
    return tpu


def _tpu_worker_group(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    groups = spec.get("workerGroupSpecs") or []
    if len(groups) != 1:
        raise InvalidInputError(
            "spec.workerGroupSpecs", f"{len(groups)} groups", "the local backend emulates exactly one TPU worker group",
            "Render the RayCluster with build_ray_cluster (one worker group of whole slices)",
        )
    group: Mapping[str, Any] = groups[0]
    return group


def _check_group_matches_slice(group: Mapping[str, Any], worker: Mapping[str, Any], tpu: TpuSlice) -> None:
    """The worker group's replicas, hosts per replica and chips per host are the annotated slice's."""
    chips = ((worker.get("resources") or {}).get("limits") or {}).get(TPU_RESOURCE)
    for field_name, found, expected in (
        ("replicas", int(group.get("replicas", group.get("minReplicas", 1))), tpu.num_slices),
        ("numOfHosts", int(group.get("numOfHosts", 1)), tpu.hosts_per_slice),
        (f"{TPU_RESOURCE} limit", None if chips is None else int(chips), tpu.host_chips),
    ):
        if found != expected:
            raise InvalidInputError(
                f"spec.workerGroupSpecs[0] {field_name}", found,
                f"does not match the TPU slice annotation ({tpu.describe()} wants {expected})",
                "Render the RayCluster with build_ray_cluster and do not edit the worker group by hand",
            )


def _check_host_count(tpu: TpuSlice, max_hosts: int | None) -> None:
    replicas, hosts = tpu.num_slices, tpu.hosts_per_slice
    total = replicas * hosts
    if max_hosts is not None and total > max_hosts:
        raise InvalidInputError(
            "topology", tpu.topology,
            f"{tpu.describe()} needs {total} TPU hosts (replicas {replicas} x numOfHosts {hosts}), more than "
            f"the local backend emulates on this machine (local_max_hosts={max_hosts})",
            f"Use a smaller topology (at most {max_hosts} hosts of {tpu.host_chips} chips), or raise "
            f"local_max_hosts in the raytpu connection's extra if this machine can run {total + 1} Ray nodes",
        )


def _head_node(head_group: Mapping[str, Any]) -> NodeSpec:
    params = head_group.get("rayStartParams") or {}
    container = _container(head_group.get("template") or {})
    return NodeSpec(
        key="head",
        num_cpus=_num_cpus(params, container, HEAD_MAX_CPUS),
        resources=_ray_param_resources(params, "headGroupSpec"),
        env=_container_env(container),
    )


@dataclass(frozen=True)
class _TpuHostTemplate:
    """What every TPU host of the worker group shares; :meth:`node` adds what GKE gives one host."""

    tpu: TpuSlice
    num_cpus: int
    extra_resources: dict[str, float]
    env: dict[str, str]

    def node(self, slice_index: int, slice_: str, worker_id: int) -> NodeSpec:
        tpu = self.tpu
        resources = {**self.extra_resources, "TPU": float(tpu.host_chips), slice_: 1.0,
                     f"accelerator_type:{tpu.ray_accelerator_type}": 1.0}
        if worker_id == 0:
            resources[tpu.head_resource] = 1.0
        return NodeSpec(
            key=f"s{slice_index}h{worker_id}",
            num_cpus=self.num_cpus,
            resources=resources,
            labels={
                LABEL_SLICE_NAME: slice_,
                LABEL_WORKER_ID: str(worker_id),
                LABEL_TOPOLOGY: tpu.topology,
                LABEL_POD_TYPE: tpu.pod_type,
                LABEL_ACCELERATOR_TYPE: tpu.ray_accelerator_type,
            },
            env={
                **self.env,
                "TPU_NAME": slice_,
                "TPU_WORKER_ID": str(worker_id),
                "TPU_ACCELERATOR_TYPE": tpu.pod_type,
                "TPU_TOPOLOGY": tpu.topology,
                "JAX_PLATFORMS": "cpu",
                **_megascale_env(self.env, slice_index),
            },
            slice_index=slice_index,
            worker_id=worker_id,
        )
