"""The RayCluster custom resource for one TPU worker group shaped by a :class:`TpuSlice`.

Only fields that exist in KubeRay v1.5.0 are rendered, so v1.5 and newer operators
accept the manifest.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.merge import merge_fragment
from airflow_provider_raytpu.manifests.names import KEY_PREFIX as KEY_PREFIX
from airflow_provider_raytpu.manifests.names import MANAGED_BY as MANAGED_BY
from airflow_provider_raytpu.manifests.names import MANAGED_BY_LABEL as MANAGED_BY_LABEL
from airflow_provider_raytpu.manifests.names import RAY_CLUSTER_NAME_LIMIT, label_value, resource_name
from airflow_provider_raytpu.manifests.options import (
    DEFAULT_CLUSTER_OPTIONS,
    DEFAULT_HEAD_RESOURCES,
    DEFAULT_WORKER_RESOURCES,
    RayClusterOptions,
)
from airflow_provider_raytpu.manifests.placement import placement_changes
from airflow_provider_raytpu.tpu import TPU_RESOURCE, TpuSlice

API_VERSION = "ray.io/v1"
DAG_ID_KEY = KEY_PREFIX + "dag-id"
DEPLOYMENT_KEY = KEY_PREFIX + "deployment"
RUN_ID_KEY = KEY_PREFIX + "run-id"
TASK_ID_KEY = KEY_PREFIX + "task-id"
MAP_INDEX_KEY = KEY_PREFIX + "map-index"  # recorded only for a mapped task: absent means not mapped
TPU_SLICE_ANNOTATION = KEY_PREFIX + "tpu-slice"
SPEC_HASH_ANNOTATION = KEY_PREFIX + "spec-hash"
ALSO_ADOPTS_ANNOTATION = KEY_PREFIX + "also-adopts"  # spec hashes an older release gave the same spec
EXPIRES_AT_ANNOTATION = KEY_PREFIX + "expires-at"
CAPACITY_TRIED_ANNOTATION = KEY_PREFIX + "capacity-tried"  # the capacity kinds a create task gave up
#: Beside the slice annotation (which older releases parse strictly): what override_tpu_placement changed.
TPU_PLACEMENT_OVERRIDDEN_ANNOTATION = KEY_PREFIX + "tpu-placement-overridden"
ORIGINATED_FROM_LABEL = "ray.io/originated-from-cr-name"  # KubeRay's, on the RayClusters of a RayService

DEFAULT_WORKER_GROUP = "tpu-slices"
DASHBOARD_PORT = 8265
SERVE_PORT = 8000
#: The port KubeRay's v6e multi-host samples open on every TPU host (the TPU runtime's multi-host DCN traffic).
MXLA_PORT = {"name": "mxla", "containerPort": 8081}
# Ports of Ray's agents that KubeRay leaves dynamic (it fixes metrics-export-port and dashboard-agent-listen-port,
# ray-operator/controllers/ray/common/pod.go). For a dynamic one the raylet waits 15 s for the agent's port file,
# then aborts (NodeManager::WaitForDashboardAgentPorts; Ray issue 65983): an agent slow to start on a busy host
# failed the pod. Each pod has a network of its own, so fixed ports cost nothing and skip two of the three waits
# (Ray 2.60's start_raylet never hands the raylet the agent's HTTP port: it waits for that file regardless).
AGENT_PORTS = {"dashboard-agent-grpc-port": "52366", "runtime-env-agent-port": "52367"}
#: What KubeRay's v6e multi-host samples set on every TPU host (the TPU runtime's control service on its node).
_HOST_ENV = {var["name"]: var for var in (
    {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    {"name": "VBAR_CONTROL_SERVICE_URL", "value": "$(NODE_IP):8353"},
    {"name": "JAX_PLATFORMS", "value": "tpu,cpu"},
    {"name": "ENABLE_PJRT_COMPATIBILITY", "value": "true"},
)}
#: Set on the hosts of a multi-slice worker group: GKE's TPU webhook adds ``MEGASCALE_SLICE_ID``,
#: ``MEGASCALE_COORDINATOR_ADDRESS`` and ``MEGASCALE_PORT`` only to a container that has it
#: (ai-on-gke kuberay-tpu-webhook, main.go ``mutatePod``: "Multi-Slice variable injection logic").
NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"
#: The share of a TPU host's vCPUs and memory its Ray container asks for by default.
HOST_SHARE = 0.75
_HEAD_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": DASHBOARD_PORT},
    {"name": "client", "containerPort": 10001},
    {"name": "serve", "containerPort": SERVE_PORT},
]


@dataclass(frozen=True)
class AirflowOrigin:
    """The Airflow task that made a resource, recorded on it as labels and annotations.

    :param dag_id: the DAG id.
    :param run_id: the DAG run id.
    :param task_id: the task id.
    :param map_index: the map index of a mapped task; -1 when the task is not mapped.
    :param deployment: the Airflow deployment the task runs in (the connection's ``deployment``): two
        deployments with the same DAG ids sharing a namespace never take each other's objects.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    deployment: str = ""

    def describe(self) -> str:
        """``DAG 'x', run 'y', task 'z'`` (``, map index 1`` for a mapped task; ``, deployment 'd'``)."""
        mapped = f", map index {self.map_index}" if self.map_index >= 0 else ""
        deployed = f", deployment {self.deployment!r}" if self.deployment else ""
        return f"DAG {self.dag_id!r}, run {self.run_id!r}, task {self.task_id!r}{mapped}{deployed}"

    def annotations(self) -> dict[str, str]:
        """The owner annotations an object this task makes carries."""
        notes = {DAG_ID_KEY: self.dag_id, TASK_ID_KEY: self.task_id, RUN_ID_KEY: self.run_id}
        if self.map_index >= 0:
            notes[MAP_INDEX_KEY] = str(self.map_index)
        if self.deployment:
            notes[DEPLOYMENT_KEY] = self.deployment
        return notes


def spec_hash(spec: Mapping[str, Any]) -> str:
    """A stable hash of a rendered spec (server-side defaults make raw comparison useless)."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def format_expiry(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_expiry(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def _env_list(env: Mapping[str, str] | None) -> list[dict[str, str]]:
    return [{"name": key, "value": str(value)} for key, value in sorted((env or {}).items())]


def _str_map(values: Mapping[str, Any]) -> dict[str, str]:
    return {key: str(value) for key, value in values.items()}


def _head_template(image: str, resources: Mapping[str, Any], env: Mapping[str, str] | None,
                   service_account: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "ray-head",
                "image": image,
                "ports": copy.deepcopy(_HEAD_PORTS),
                "resources": {"requests": _str_map(resources), "limits": _str_map(resources)},
                "env": _env_list(env),
            }
        ],
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"spec": spec}


def host_resources(tpu: TpuSlice) -> dict[str, str]:
    """CPU and memory of a TPU host's Ray container by default: :data:`HOST_SHARE` of its GKE machine type
    (the rest is GKE's: system reserves and the node's DaemonSets), or a small fixed size for a shape GKE
    does not offer."""
    machine = tpu.machine_type
    if machine is None:
        return dict(DEFAULT_WORKER_RESOURCES)
    return {"cpu": str(int(machine.vcpus * HOST_SHARE)), "memory": f"{int(machine.memory_gb * HOST_SHARE)}G"}


def _opens_mxla_port(tpu: TpuSlice) -> bool:
    """A v6e multi-host slice (KubeRay's samples), or several slices: their hosts talk over the data
    centre network on port 8081 (``MEGASCALE_PORT``)."""
    return (tpu.accelerator == "v6e" and tpu.is_multi_host) or tpu.num_slices > 1


def _host_env(tpu: TpuSlice, env: Mapping[str, str] | None) -> list[dict[str, Any]]:
    """A TPU host's environment: what KubeRay's v6e multi-host samples set (the TPU runtime's control
    service on the node, JAX on the TPU first), :data:`NUM_SLICES_ENV` for several slices, then ``env``
    (the user's, winning)."""
    given = _env_list(env)
    ours = list(_HOST_ENV.values()) if tpu.accelerator == "v6e" and tpu.is_multi_host else []
    if tpu.num_slices > 1:
        ours.append({"name": NUM_SLICES_ENV, "value": str(tpu.num_slices)})
    taken = {var["name"] for var in given}
    return [copy.deepcopy(var) for var in ours if var["name"] not in taken] + given


def _worker_template(tpu: TpuSlice, image: str, resources: Mapping[str, Any],
                     env: Mapping[str, str] | None, service_account: str | None) -> dict[str, Any]:
    limits = {**_str_map(resources), TPU_RESOURCE: str(tpu.host_chips)}
    tolerations = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}, *tpu.capacity.tolerations]
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "ray-worker",
                "image": image,
                "resources": {"requests": dict(limits), "limits": limits},
                "env": _host_env(tpu, env),
                **({"ports": [dict(MXLA_PORT)]} if _opens_mxla_port(tpu) else {}),
            }
        ],
        "nodeSelector": tpu.node_selector,
        "tolerations": tolerations,
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"spec": spec}


def build_ray_cluster(
    *,
    name: str,
    namespace: str,
    tpu: TpuSlice,
    options: RayClusterOptions = DEFAULT_CLUSTER_OPTIONS,
    origin: AirflowOrigin | None = None,
    expires_at: datetime | None = None,
    worker_group_name: str = DEFAULT_WORKER_GROUP,
) -> dict[str, Any]:
    """Render a ray.io/v1 RayCluster: a CPU head and one TPU worker group of whole slices.

    The worker group has ``replicas = minReplicas = maxReplicas = num_slices`` and
    ``numOfHosts = hosts per slice``; each host pod asks for all of its host's chips
    and selects the slice's GKE node pool. The :class:`TpuSlice` and a hash of the
    spec are recorded as annotations (later tasks read the shape from the cluster;
    create compares the hash to decide between adopt and conflict).

    :param name: the cluster name; normalised to an RFC 1123 label of at most 53 characters.
    :param namespace: the Kubernetes namespace.
    :param tpu: the slice shape of the worker group.
    :param options: image, resources, env, ray start flags, service account, labels,
        annotations and pod-template fragments (see :class:`RayClusterOptions`).
    :param origin: the Airflow task creating it, recorded as labels and annotations.
    :param expires_at: when :class:`DeleteExpiredRayClustersOperator` may delete it.
    :param worker_group_name: the worker group's name.
    """
    name = resource_name(name, "cluster_name", RAY_CLUSTER_NAME_LIMIT)
    image, env, service_account_name = options.image, options.env, options.service_account_name
    head_template = merge_fragment(
        _head_template(image, options.head_resources or DEFAULT_HEAD_RESOURCES, env, service_account_name),
        dict(options.head_pod_template or {}),
    )
    rendered = _worker_template(tpu, image, options.worker_resources or host_resources(tpu), env,
                                service_account_name)
    worker_template = merge_fragment(rendered, dict(options.worker_pod_template or {}))
    overridden = placement_changes(rendered, worker_template)
    if overridden and not options.override_tpu_placement:
        raise InvalidInputError(
            "worker_pod_template", options.worker_pod_template,
            f"changes how the TPU hosts are placed on their slice ({'; '.join(overridden)})",
            "Leave the node selectors, TPU tolerations and google.com/tpu to accelerator, topology and capacity; "
            f"or, to place the hosts yourself, set override_tpu_placement=True (the cluster then records what was "
            f"overridden in {TPU_PLACEMENT_OVERRIDDEN_ANNOTATION})")
    spec: dict[str, Any] = {
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": _str_map({"dashboard-host": "0.0.0.0", **AGENT_PORTS,
                                        **(options.head_ray_start_params or {})}),
            "template": head_template,
        },
        "workerGroupSpecs": [
            {
                "groupName": worker_group_name,
                "replicas": tpu.num_slices,
                "minReplicas": tpu.num_slices,
                "maxReplicas": tpu.num_slices,
                "numOfHosts": tpu.hosts_per_slice,
                "rayStartParams": _str_map({**AGENT_PORTS, **(options.worker_ray_start_params or {})}),
                "template": worker_template,
            }
        ],
    }
    if version := options.ray_version or _ray_version_of(image):
        spec["rayVersion"] = version
    notes = {TPU_PLACEMENT_OVERRIDDEN_ANNOTATION: json.dumps(overridden)} if overridden else None
    return owned_resource("RayCluster", name, namespace, spec, tpu=tpu, options=options, origin=origin, notes=notes,
                          expires_at=expires_at, also_adopts=[spec_hash(as_released_in_0_1(spec, tpu, options))])


def as_released_in_0_1(spec: Mapping[str, Any], tpu: TpuSlice, options: RayClusterOptions) -> dict[str, Any]:
    """``spec`` as release 0.1 rendered it: a TPU host sized 8 CPU / 32Gi unless ``worker_resources`` was given,
    no fixed agent ports, and no v6e multi-host or multi-slice env or port. A RayCluster that release made has
    this spec's hash, and a retry after the upgrade adopts it (``raytpu.dev/also-adopts``)."""
    old = copy.deepcopy(dict(spec))
    groups = old.get("workerGroupSpecs") or []
    start_params = [(old.get("headGroupSpec") or {}, options.head_ray_start_params)]
    for group, params in start_params + [(group, options.worker_ray_start_params) for group in groups]:
        for port in AGENT_PORTS.keys() - set(params or {}):
            (group.get("rayStartParams") or {}).pop(port, None)
    containers = groups[0]["template"]["spec"]["containers"] if groups else []
    for host in (c for c in containers if c.get("name") == "ray-worker"):
        if options.worker_resources is None:
            limits = {**DEFAULT_WORKER_RESOURCES, TPU_RESOURCE: str(tpu.host_chips)}
            host["resources"] = {"requests": dict(limits), "limits": limits}
        given = set(options.env or {})
        ours = {*_HOST_ENV, NUM_SLICES_ENV}
        host["env"] = [var for var in host.get("env") or [] if var["name"] in given or var["name"] not in ours]
        if host.get("ports") == [MXLA_PORT]:
            del host["ports"]
    return old


def owned_resource(
    kind: str,
    name: str,
    namespace: str,
    spec: dict[str, Any],
    *,
    tpu: TpuSlice,
    options: RayClusterOptions,
    origin: AirflowOrigin | None,
    notes: Mapping[str, str] | None = None,
    expires_at: datetime | None = None,
    also_adopts: list[str] | None = None,
) -> dict[str, Any]:
    """A ray.io/v1 object of ``kind`` with what every object made here carries: the managed-by
    label, the user's labels and annotations, the slice shape, ``notes``, the origin task, the
    expiry and, last, the spec hash (and the hashes of equal specs an older release rendered, which a
    create adopts as its own: ``also_adopts``)."""
    labels = {MANAGED_BY_LABEL: MANAGED_BY, **(options.labels or {})}
    annotations = {**(options.annotations or {}), TPU_SLICE_ANNOTATION: json.dumps(tpu.to_dict(), sort_keys=True),
                   **(notes or {})}
    if origin:
        labels.update({DAG_ID_KEY: label_value(origin.dag_id), TASK_ID_KEY: label_value(origin.task_id),
                       RUN_ID_KEY: label_value(origin.run_id)})
        if origin.deployment:
            labels[DEPLOYMENT_KEY] = origin.deployment
        annotations.update(origin.annotations())
    if expires_at:
        annotations[EXPIRES_AT_ANNOTATION] = format_expiry(expires_at)
    annotations[SPEC_HASH_ANNOTATION] = spec_hash(spec)
    if older := sorted(set(also_adopts or ()) - {annotations[SPEC_HASH_ANNOTATION]}):
        annotations[ALSO_ADOPTS_ANNOTATION] = json.dumps(older)
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


def _ray_version_of(image: str) -> str:
    """``rayproject/ray:2.60.0-py311-tpu`` -> ``2.60.0``; images without a version tag give ``""``."""
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    version = tag.split("-", 1)[0]
    return version if version[:1].isdigit() else ""


def tpu_slice_of(cluster: Mapping[str, Any]) -> TpuSlice | None:
    """The slice shape recorded on a RayCluster (or a RayService's cluster), if any."""
    text = (cluster.get("metadata", {}).get("annotations") or {}).get(TPU_SLICE_ANNOTATION)
    return TpuSlice.from_dict(json.loads(text)) if text else None
