"""A RayCluster's status, read from the object and its pods.

KubeRay's ``status.state`` is set to ``ready`` once and never reset, so it is not
trusted here: a cluster is READY only when the head pod is ready and every TPU host
of every slice is ready.

KubeRay sets the ``ReplicaFailure`` condition on any reconcile error (a pod refused by a
quota or a webhook timeout) and removes it on the next good reconcile, so it is read as
PROVISIONING with its reason and since when it holds; whoever waits decides when it has
lasted too long (:class:`ReconcileFailureGrace`). ``state: failed`` (which KubeRay v1.5
and newer never set; the local backend sets it for a failure no wait can outlive, such as
Ray processes that cannot start) is FAILED.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

from airflow_provider_raytpu.status.conditions import conditions, is_true, parse_time
from airflow_provider_raytpu.status.plain import plain_fields

REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
HOST_INDEX_LABEL = "ray.io/replica-host-index"
NODE_TYPE_LABEL = "ray.io/node-type"
#: The reason of a cluster whose pods are ready but whose TPU hosts Ray does not list as reservable slices yet.
RAY_UNCONFIRMED = "RayHostsUnconfirmed"
#: The reason of a cluster whose TPU pods GKE's TPU webhook did not mutate.
TPU_WEBHOOK_MISSING = "TpuWebhookMissing"
#: The reason of a cluster whose Kueue Workload cannot be admitted at all (its LocalQueue or ClusterQueue is missing).
KUEUE_INADMISSIBLE = "KueueInadmissible"


class Phase(str, Enum):
    """Where a RayCluster is in its life."""

    PROVISIONING = "PROVISIONING"
    READY = "READY"
    FAILED = "FAILED"
    SUSPENDED = "SUSPENDED"
    GONE = "GONE"


@dataclass(frozen=True)
class SliceStatus:
    """Readiness of one slice (one replica of the TPU worker group).

    :param index: the replica index KubeRay gives the slice's pods.
    :param ready_hosts: host pods of the slice that are ready.
    :param hosts: host pods the slice has now.
    :param scheduled_hosts: host pods of the slice placed on a node (its capacity came).
    """

    index: str
    ready_hosts: int
    hosts: int
    scheduled_hosts: int = 0


@dataclass(frozen=True)
class ClusterStatus:
    """A RayCluster's state as the provider understands it.

    :param phase: the phase.
    :param message: one human line: what is ready, what is missing, or why it failed.
    :param head_ready: whether the head pod is ready.
    :param ready_hosts: TPU host pods ready, over all slices.
    :param desired_hosts: TPU host pods wanted (slices x hosts per slice).
    :param reason: the failure reason, when FAILED; the reconcile failure KubeRay reports
        (e.g. ``FailedCreateWorkerPod``), when PROVISIONING.
    :param slices: per-slice readiness, when pods were read.
    :param failing_since: when the reconcile failure began (the condition's
        ``lastTransitionTime``, RFC 3339), when KubeRay says.
    :param ray_hosts: TPU hosts Ray lists with their chips and slice, when Ray was asked
        (``confirm_with_ray``); ``None`` when it was not.
    """

    phase: Phase
    message: str
    head_ready: bool = False
    ready_hosts: int = 0
    desired_hosts: int = 0
    reason: str = ""
    slices: tuple[SliceStatus, ...] = field(default=())
    failing_since: str = ""
    ray_hosts: int | None = None

    @property
    def finished(self) -> bool:
        """Whether waiting for this cluster can stop (ready, failed or deleted)."""
        return self.phase in (Phase.READY, Phase.FAILED, Phase.GONE)

    @property
    def scheduled_hosts(self) -> int:
        """TPU host pods placed on a node, over all slices (0 when pods were not read)."""
        return sum(s.scheduled_hosts for s in self.slices)

    @property
    def reconcile_failing(self) -> bool:
        """Whether the cluster is PROVISIONING with a reason that may not last: a KubeRay reconcile failure,
        or TPU hosts Ray does not list yet."""
        return self.phase is Phase.PROVISIONING and bool(self.reason)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (lists, not tuples): the sensor returns it as its XCom."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterStatus:
        return cls(
            **{
                **data,
                "phase": Phase(data["phase"]),
                "slices": tuple(SliceStatus(**s) for s in data.get("slices", ())),
            }
        )


class _CommonFields(TypedDict):
    """The :class:`ClusterStatus` fields :func:`read_ray_cluster` gives whatever the phase."""

    head_ready: bool
    ready_hosts: int
    desired_hosts: int
    slices: tuple[SliceStatus, ...]


def desired_hosts(cluster: Mapping[str, Any]) -> int:
    """TPU/worker host pods the spec asks for: replicas x numOfHosts over active groups."""
    total = 0
    for group in cluster.get("spec", {}).get("workerGroupSpecs") or []:
        if not group.get("suspend"):
            total += int(group.get("replicas", group.get("minReplicas", 0))) * int(group.get("numOfHosts", 1))
    return total


def read_ray_cluster(
    cluster: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]] | None = None
) -> ClusterStatus:
    """Interpret a RayCluster object (``None`` when it does not exist).

    :param cluster: the RayCluster as returned by the API server.
    :param pods: the cluster's pods, when read, for per-slice detail.
    """
    if cluster is None:
        return ClusterStatus(Phase.GONE, "the RayCluster does not exist")
    metadata = cluster.get("metadata", {})
    status = cluster.get("status") or {}
    by_type = conditions(status)
    slices = read_slices(pods) if pods is not None else ()
    want = desired_hosts(cluster)
    reported_want = status.get("desiredWorkerReplicas")
    ready = int(status.get("readyWorkerReplicas") or 0)
    head_ready = is_true(by_type.get("HeadPodReady"))
    common: _CommonFields = {"head_ready": head_ready, "ready_hosts": ready, "desired_hosts": want, "slices": slices}

    if metadata.get("deletionTimestamp"):
        return ClusterStatus(Phase.GONE, "the RayCluster is being deleted", **common)
    if status.get("state") == "failed":
        text = status.get("reason") or "failed"
        return ClusterStatus(Phase.FAILED, f"the RayCluster failed: {text}", reason=text.split(":", 1)[0], **common)
    failure = by_type.get("ReplicaFailure")
    if is_true(failure):
        reason = failure.get("reason") or "ReplicaFailure"
        since = failure.get("lastTransitionTime") or ""
        text = f"{reason}: {failure.get('message', '')}".rstrip(": ")
        return ClusterStatus(Phase.PROVISIONING, f"KubeRay cannot reconcile it{f' since {since}' if since else ''} "
                             f"({text}); {_hosts_message(ready, want, slices)}", reason=reason, failing_since=since,
                             **common)
    suspend = cluster.get("spec", {}).get("suspend")
    if suspend or (suspend is None and (status.get("state") == "suspended" or is_true(
            by_type.get("RayClusterSuspended")))):
        return ClusterStatus(Phase.SUSPENDED, "the RayCluster is suspended", **common)
    # ``suspend: false`` with a status still saying suspended: resumed (Kueue admitted it), and KubeRay's status
    # says so only once the pods are up.

    observed = status.get("observedGeneration")
    if observed is not None and metadata.get("generation") is not None and observed < metadata["generation"]:
        return ClusterStatus(Phase.PROVISIONING, "KubeRay has not yet reconciled the latest spec", **common)
    hosts = _hosts_message(ready, want, slices)
    if not head_ready:
        return ClusterStatus(Phase.PROVISIONING, f"head not ready; {hosts}", **common)
    if reported_want is not None and int(reported_want) != want:
        return ClusterStatus(
            Phase.PROVISIONING, f"KubeRay reports {reported_want} desired hosts, spec asks {want}; {hosts}", **common
        )
    if ready < want or any(s.ready_hosts < s.hosts for s in slices):
        return ClusterStatus(Phase.PROVISIONING, f"head ready; {hosts}", **common)
    return ClusterStatus(Phase.READY, f"head ready; {hosts}", **common)


class ReconcileFailureGrace:
    """Decides when a KubeRay reconcile failure (``ReplicaFailure``), ready pods whose TPU hosts Ray does not
    list (:data:`RAY_UNCONFIRMED`), or a Kueue Workload that cannot be admitted (:data:`KUEUE_INADMISSIBLE`)
    have lasted too long to wait on.

    A failure is transient until it holds for ``grace`` seconds since it began (KubeRay's
    ``lastTransitionTime``, else when this waiter first saw it); then the status is FAILED.

    :param grace: seconds a reconcile failure may last.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.first_seen: float | None = None

    def since(self, status: ClusterStatus, now: float) -> float | None:
        """When the failure began (Unix time), or ``None`` when there is none."""
        if not status.reconcile_failing:
            self.first_seen = None
            return None
        if status.failing_since:
            try:
                return parse_time(status.failing_since).timestamp()
            except ValueError:
                pass
        if self.first_seen is None:
            self.first_seen = now
        return self.first_seen

    def judge(self, status: ClusterStatus, now: float) -> ClusterStatus:
        """``status``, FAILED instead when its reconcile failure has lasted ``grace`` seconds."""
        since = self.since(status, now)
        if since is None or now - since < self.grace:
            return status
        what = {RAY_UNCONFIRMED: "Ray has not listed its TPU hosts",
                KUEUE_INADMISSIBLE: "Kueue could not admit it"}.get(status.reason, "KubeRay could not reconcile it")
        return dataclasses.replace(
            status, phase=Phase.FAILED,
            message=f"{what} for {now - since:.0f} s, longer than the grace period of {self.grace:.0f} s: "
                    f"{status.message}",
        )

    def seconds_left(self, status: ClusterStatus, now: float) -> float | None:
        """Seconds until ``status``'s reconcile failure becomes fatal, or ``None`` when there is none."""
        since = self.since(status, now)
        return None if since is None else max(0.0, since + self.grace - now)


def _hosts_message(ready: int, want: int, slices: tuple[SliceStatus, ...]) -> str:
    text = f"{ready} of {want} TPU hosts ready"
    if slices:
        text += " (" + ", ".join(f"slice {s.index}: {s.ready_hosts}/{s.hosts}" for s in slices) + ")"
    return text


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Running and Ready, and not being deleted: a terminating pod (KubeRay deleting a slice to make it again)
    stays Ready until its containers stop, but is no host of the slice any more."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and is_true(conditions(status).get("Ready"))


def pod_is_scheduled(pod: Mapping[str, Any]) -> bool:
    """Placed on a node (``spec.nodeName``, which the scheduler sets on binding), and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return bool((pod.get("spec") or {}).get("nodeName"))


def read_slices(pods: Iterable[Mapping[str, Any]]) -> tuple[SliceStatus, ...]:
    """Group worker pods by their slice (replica index) and count ready and scheduled hosts."""
    counts: dict[str, list[int]] = {}
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if labels.get(NODE_TYPE_LABEL) != "worker" or REPLICA_INDEX_LABEL not in labels:
            continue
        ready_total = counts.setdefault(labels[REPLICA_INDEX_LABEL], [0, 0, 0])
        ready_total[0] += pod_is_ready(pod)
        ready_total[1] += 1
        ready_total[2] += pod_is_scheduled(pod)
    return tuple(
        SliceStatus(index, ready, total, scheduled)
        for index, (ready, total, scheduled) in sorted(counts.items(), key=lambda kv: (len(kv[0]), kv[0]))
    )
