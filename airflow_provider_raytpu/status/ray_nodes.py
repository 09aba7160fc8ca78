"""Whether Ray can reserve a cluster's TPU slices: its node list read against the cluster's TPU host pods.

Pod readiness says a host's raylet is alive; it does not say that Ray knows the host as part of a
slice. JaxTrainer (``ray.util.tpu.reserve_tpu_slice``) reserves a slice through the one host that
carries ``TPU-<pod type>-head`` and then every host labelled with that host's
``ray.io/tpu-slice-name``, each with its ``TPU`` chips. Ray derives those from the ``TPU_NAME`` /
``TPU_WORKER_ID`` variables GKE's TPU webhook puts in the pods (``ray/_private/accelerators/tpu.py``:
``get_current_node_additional_resources``, ``get_current_node_accelerator_labels``); without them the
hosts join with chips but no slice, and the reservation times out long after the pods were ready.

The node list is the answer of Ray's State API, ``GET /api/v0/nodes`` (what ``ray list nodes`` reads:
``ray/util/state/api.py``, ``StateApiClient._make_http_get_request``): ``{"result": bool, "msg": str,
"data": {"result": {"total", "num_after_truncation", "result": [NodeState...]}}}``, each node with
``node_ip``, ``is_head_node``, ``state``, ``resources_total`` and ``labels``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_raytpu.status.cluster import (
    NODE_TYPE_LABEL,
    RAY_UNCONFIRMED,
    REPLICA_INDEX_LABEL,
    ClusterStatus,
    Phase,
    pod_is_ready,
)
from airflow_provider_raytpu.tpu import TPU_RESOURCE
from airflow_provider_raytpu.values import plural

SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
#: Problems named in one line before the rest are counted.
SHOWN = 4


class RayAnswerError(ValueError):
    """Ray's State API answered something other than a complete node list."""


@dataclass(frozen=True)
class RayNode:
    """One ALIVE node as Ray's State API lists it.

    :param ip: the node's IP (a Kubernetes pod's IP).
    :param is_head: whether it is the Ray head.
    :param resources: its total resources.
    :param labels: its labels.
    """

    ip: str
    is_head: bool
    resources: Mapping[str, float]
    labels: Mapping[str, str]

    @property
    def chips(self) -> float:
        return float(self.resources.get("TPU", 0))

    @property
    def slice_name(self) -> str:
        return self.labels.get(SLICE_NAME_LABEL, "")

    @property
    def carries_slice_head(self) -> bool:
        """Whether it has the ``TPU-<pod type>-head`` resource JaxTrainer reserves a slice through."""
        return any(key.startswith("TPU-") and key.endswith("-head") for key in self.resources)


@dataclass(frozen=True)
class TpuHost:
    """A TPU host pod: what Ray should list for it.

    :param pod: the pod's name.
    :param slice_index: its slice (KubeRay's replica index).
    :param chips: the ``google.com/tpu`` chips its containers were given.
    :param ip: the pod's IP, when known.
    """

    pod: str
    slice_index: str
    chips: int
    ip: str = ""


@dataclass(frozen=True)
class RayCheck:
    """What Ray lists against what the pods promise.

    :param hosts: TPU host pods.
    :param confirmed: hosts Ray lists with their chips and a slice name.
    :param problems: what Ray lacks, one phrase each (empty: every slice can be reserved).
    """

    hosts: int
    confirmed: int
    problems: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        counted = f"Ray lists {self.confirmed} of {plural(self.hosts, 'TPU host')} with their chips and slice"
        if not self.problems:
            return f"{counted}, one slice head per slice"
        shown = "; ".join(self.problems[:SHOWN])
        more = len(self.problems) - SHOWN
        return f"{counted}; {shown}" + (f"; and {more} more" if more > 0 else "")


def read_nodes_answer(answer: Any) -> list[RayNode]:
    """The ALIVE nodes of a ``GET /api/v0/nodes`` answer.

    :raises RayAnswerError: Ray said it failed (``result: false``), the list was cut short
        (``num_after_truncation`` below ``total``), or the answer is not a node list.
    """
    try:
        if answer.get("result") is False:
            raise RayAnswerError(f"Ray's State API failed: {answer.get('msg') or 'no message'}")
        listing = answer["data"]["result"]
        nodes = listing["result"]
        total = listing.get("total")
        if total is not None and len(nodes) < int(total) and listing.get("num_after_truncation", total) < total:
            raise RayAnswerError(f"Ray's State API listed {len(nodes)} of {total} nodes")
        return [
            RayNode(str(node.get("node_ip", "")), bool(node.get("is_head_node")),
                    dict(node.get("resources_total") or {}), dict(node.get("labels") or {}))
            for node in nodes if node.get("state", "ALIVE") == "ALIVE"
        ]
    except (AttributeError, KeyError, TypeError) as exc:
        raise RayAnswerError(f"not a node list from Ray's State API ({type(exc).__name__}: {exc})") from exc


def container_chips(container: Mapping[str, Any]) -> int:
    """The ``google.com/tpu`` chips of one container (its limit; its request when there is no limit)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(TPU_RESOURCE) or (resources.get("requests") or {}).get(TPU_RESOURCE)
    return int(str(value)) if value not in (None, "") else 0


def pod_chips(pod: Mapping[str, Any]) -> int:
    """The ``google.com/tpu`` chips of a pod's containers."""
    return sum(container_chips(c) for c in (pod.get("spec") or {}).get("containers") or [])


def tpu_hosts(pods: Iterable[Mapping[str, Any]]) -> list[TpuHost]:
    """The ready worker pods that were given TPU chips."""
    hosts = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        chips = pod_chips(pod)
        if labels.get(NODE_TYPE_LABEL) == "worker" and chips and pod_is_ready(pod):
            hosts.append(TpuHost(metadata.get("name", "?"), labels.get(REPLICA_INDEX_LABEL, "?"), chips,
                                 str((pod.get("status") or {}).get("podIP") or "")))
    return hosts


def named_list(items: list[str]) -> str:
    """The first :data:`SHOWN` of ``items``, comma-separated, and how many more."""
    return ", ".join(items[:SHOWN]) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


@dataclass
class _HostMatch:
    """Ray's worker nodes matched to the TPU host pods, and what each node lacks.

    :param hosts: the TPU host pods.
    :param by_ip: the pods whose IP tells them apart (on the local backend every host shares one: empty).
    """

    hosts: list[TpuHost]
    by_ip: dict[str, TpuHost]
    no_chips: list[str] = dataclasses.field(default_factory=list)
    no_slice: list[str] = dataclasses.field(default_factory=list)
    slices: dict[str, list[RayNode]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    confirmed: int = 0

    @classmethod
    def of(cls, hosts: list[TpuHost]) -> _HostMatch:
        ips = collections.Counter(h.ip for h in hosts if h.ip)
        return cls(hosts, {h.ip: h for h in hosts if h.ip and ips[h.ip] == 1})

    def name(self, node: RayNode) -> str:
        host = self.by_ip.get(node.ip)
        where = f"pod {host.pod}" if host else f"node {node.ip}"
        worker = node.labels.get(WORKER_ID_LABEL)
        return where + (f" (slice {node.slice_name} worker {worker})" if node.slice_name and worker else "")

    def read(self, node: RayNode) -> None:
        """One worker node: its chips against its pod's, and the slice it names."""
        host = self.by_ip.get(node.ip)
        if host is None and self.by_ip:
            return  # not one of the ready TPU pods (a CPU worker, a host still starting, a replaced one)
        chips_everywhere = {h.chips for h in self.hosts}
        want = host.chips if host else next(iter(chips_everywhere)) if len(chips_everywhere) == 1 else None
        if not node.chips or (want is not None and node.chips != want):
            self.no_chips.append(f"{self.name(node)} has TPU={node.chips:g}" + (f", its pod {want}" if want else ""))
        if node.slice_name:
            self.slices[node.slice_name].append(node)
        elif node.chips:
            self.no_slice.append(self.name(node))
        if node.chips and node.slice_name and (want is None or node.chips == want):
            self.confirmed += 1

    def listing_problems(self, workers: list[RayNode]) -> list[str]:
        """TPU host pods that Ray does not list (by IP, or by count where IPs do not tell pods apart)."""
        if not self.by_ip:
            if len(workers) < len(self.hosts):
                return [f"Ray lists {len(workers)} of {plural(len(self.hosts), 'TPU host')}"]
            return []
        listed = {n.ip for n in workers}
        unlisted = [h for h in self.hosts if h.ip in self.by_ip and h.ip not in listed]
        if not unlisted:
            return []
        return [f"Ray does not list {plural(len(unlisted), 'TPU host')}: "
                + named_list([f"pod {h.pod} (slice {h.slice_index})" for h in unlisted])]

    def slice_problems(self) -> list[str]:
        """Hosts without chips or a slice name; slices whose sizes or heads differ from the pods'."""
        problems = [f"no TPU chips registered by {named_list(self.no_chips)}"] if self.no_chips else []
        if self.no_slice:
            problems.append(f"no {SLICE_NAME_LABEL} label on {named_list(self.no_slice)} "
                            "(TPU_NAME and TPU_WORKER_ID not set)")
        want_sizes = sorted(collections.Counter(h.slice_index for h in self.hosts).values())
        have_sizes = sorted(len(members) for members in self.slices.values())
        if self.slices and have_sizes != want_sizes:
            problems.append(f"Ray's slices have {_sizes(have_sizes)} hosts, the pods' {_sizes(want_sizes)}")
        heads = [f"{slice_name} has {len([n for n in members if n.carries_slice_head])}"
                 for slice_name, members in sorted(self.slices.items())
                 if len([n for n in members if n.carries_slice_head]) != 1]
        if heads:
            problems.append(f"one TPU-<pod type>-head per slice needed: {named_list(heads)}")
        return problems


def check_ray_nodes(hosts: list[TpuHost], nodes: Iterable[RayNode]) -> RayCheck:
    """Read Ray's nodes against the TPU host pods: per slice, every host with its chips, one slice name
    shared by the slice's hosts only, and one ``TPU-<pod type>-head``.

    A node is matched to its pod by IP where IPs tell pods apart (on Kubernetes, the pod's IP
    is the Ray node's); otherwise (every host on one address, as on the local backend) by count.

    :param hosts: the TPU host pods (:func:`tpu_hosts`).
    :param nodes: Ray's ALIVE nodes (:func:`read_nodes_answer`).
    """
    if not hosts:
        return RayCheck(0, 0, ())
    match = _HostMatch.of(hosts)
    workers = [n for n in nodes if not n.is_head]
    for node in workers:
        match.read(node)
    problems = match.listing_problems(workers) + match.slice_problems()
    confirmed = match.confirmed if match.by_ip else min(match.confirmed, len(hosts))
    return RayCheck(len(hosts), confirmed, tuple(problems))


def _sizes(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes)


def confirm_with_ray(
    status: ClusterStatus, pods: Iterable[Mapping[str, Any]], nodes: Iterable[RayNode]
) -> ClusterStatus:
    """``status`` (READY by its pods) as Ray sees it: READY when Ray can reserve every slice, else
    PROVISIONING with reason :data:`RAY_UNCONFIRMED` and what Ray lacks."""
    check = check_ray_nodes(tpu_hosts(pods), nodes)
    message = f"{status.message}; {check.describe()}" if check.hosts else status.message
    if check.complete:
        return dataclasses.replace(status, message=message, ray_hosts=check.confirmed)
    return dataclasses.replace(status, phase=Phase.PROVISIONING, message=message, reason=RAY_UNCONFIRMED,
                               ray_hosts=check.confirmed)


def ray_unanswered(status: ClusterStatus, problem: str) -> ClusterStatus:
    """``status`` (READY by its pods) when Ray's node list could not be read: PROVISIONING, reason
    :data:`RAY_UNCONFIRMED`, saying why."""
    return dataclasses.replace(status, phase=Phase.PROVISIONING, reason=RAY_UNCONFIRMED,
                               message=f"{status.message}; asking Ray which hosts it lists: {problem}")
