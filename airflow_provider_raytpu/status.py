"""Pure reading of KubeRay status into a small state model.

KubeRay's ``status.state`` is set to ``ready`` once and never reset, so it is not
trusted here: a cluster is READY only when the head pod is ready and every TPU host
of every slice is ready.

A RayService is RUNNING for a model version only when its ACTIVE cluster is the one
made for that version (see :func:`read_ray_service`): during a switch the old cluster
keeps serving, Ready and RUNNING, and must not count.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import yaml

REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
HOST_INDEX_LABEL = "ray.io/replica-host-index"
NODE_TYPE_LABEL = "ray.io/node-type"


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
    """

    index: str
    ready_hosts: int
    hosts: int


@dataclass(frozen=True)
class ClusterStatus:
    """A RayCluster's state as the provider understands it.

    :param phase: the phase.
    :param message: one human line: what is ready, what is missing, or why it failed.
    :param head_ready: whether the head pod is ready.
    :param ready_hosts: TPU host pods ready, over all slices.
    :param desired_hosts: TPU host pods wanted (slices x hosts per slice).
    :param reason: the failure reason, when FAILED.
    :param slices: per-slice readiness, when pods were read.
    """

    phase: Phase
    message: str
    head_ready: bool = False
    ready_hosts: int = 0
    desired_hosts: int = 0
    reason: str = ""
    slices: tuple[SliceStatus, ...] = field(default=())

    @property
    def finished(self) -> bool:
        """Whether waiting for this cluster can stop (ready, failed or deleted)."""
        return self.phase in (Phase.READY, Phase.FAILED, Phase.GONE)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        data["slices"] = [asdict(s) for s in self.slices]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterStatus:
        return cls(
            **{
                **data,
                "phase": Phase(data["phase"]),
                "slices": tuple(SliceStatus(**s) for s in data.get("slices", ())),
            }
        )


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in status.get("conditions") or []}


def _is_true(condition: Mapping[str, Any] | None) -> bool:
    return bool(condition) and condition.get("status") == "True"


def desired_hosts(cluster: Mapping[str, Any]) -> int:
    """TPU/worker host pods the spec asks for: replicas x numOfHosts over active groups."""
    total = 0
    for group in cluster.get("spec", {}).get("workerGroupSpecs") or []:
        if not group.get("suspend"):
            total += int(group.get("replicas", group.get("minReplicas", 0))) * int(group.get("numOfHosts", 1))
    return total


def read_ray_cluster(cluster: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]] | None = None) -> ClusterStatus:
    """Interpret a RayCluster object (``None`` when it does not exist).

    :param cluster: the RayCluster as returned by the API server.
    :param pods: the cluster's pods, when read, for per-slice detail.
    """
    if cluster is None:
        return ClusterStatus(Phase.GONE, "the RayCluster does not exist")
    metadata = cluster.get("metadata", {})
    status = cluster.get("status") or {}
    conditions = _conditions(status)
    slices = read_slices(pods) if pods is not None else ()
    want = desired_hosts(cluster)
    reported_want = status.get("desiredWorkerReplicas")
    ready = int(status.get("readyWorkerReplicas") or 0)
    head_ready = _is_true(conditions.get("HeadPodReady"))
    common = {"head_ready": head_ready, "ready_hosts": ready, "desired_hosts": want, "slices": slices}

    if metadata.get("deletionTimestamp"):
        return ClusterStatus(Phase.GONE, "the RayCluster is being deleted", **common)
    failure = conditions.get("ReplicaFailure")
    if _is_true(failure):
        reason = failure.get("reason", "ReplicaFailure")
        return ClusterStatus(Phase.FAILED, f"{reason}: {failure.get('message', '')}".rstrip(": "), reason=reason, **common)
    if status.get("state") == "failed":
        reason = status.get("reason") or "failed"
        return ClusterStatus(Phase.FAILED, f"KubeRay reports the cluster failed: {reason}", reason=reason, **common)
    if cluster.get("spec", {}).get("suspend") or status.get("state") == "suspended" or _is_true(
        conditions.get("RayClusterSuspended")
    ):
        return ClusterStatus(Phase.SUSPENDED, "the RayCluster is suspended", **common)

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


def _hosts_message(ready: int, want: int, slices: tuple[SliceStatus, ...]) -> str:
    text = f"{ready} of {want} TPU hosts ready"
    if slices:
        text += " (" + ", ".join(f"slice {s.index}: {s.ready_hosts}/{s.hosts}" for s in slices) + ")"
    return text


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and _is_true(_conditions(status).get("Ready"))


def read_slices(pods: Iterable[Mapping[str, Any]]) -> tuple[SliceStatus, ...]:
    """Group worker pods by their slice (replica index) and count ready hosts."""
    counts: dict[str, list[int]] = {}
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if labels.get(NODE_TYPE_LABEL) != "worker" or REPLICA_INDEX_LABEL not in labels:
            continue
        ready_total = counts.setdefault(labels[REPLICA_INDEX_LABEL], [0, 0])
        ready_total[0] += pod_is_ready(pod)
        ready_total[1] += 1
    return tuple(
        SliceStatus(index, ready, total)
        for index, (ready, total) in sorted(counts.items(), key=lambda kv: (len(kv[0]), kv[0]))
    )


def _pod_label(pod: Mapping[str, Any]) -> str:
    labels = pod.get("metadata", {}).get("labels") or {}
    name = pod.get("metadata", {}).get("name", "?")
    if labels.get(NODE_TYPE_LABEL) == "head":
        return f"head (pod {name})"
    if REPLICA_INDEX_LABEL not in labels:
        return f"worker (pod {name})"
    host = labels.get(HOST_INDEX_LABEL)
    return f"slice {labels[REPLICA_INDEX_LABEL]}{f' host {host}' if host else ''} (pod {name})"


def _pod_reason(pod: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> str:
    status = pod.get("status") or {}
    scheduled = _conditions(status).get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"{scheduled.get('reason', 'not scheduled')}: {scheduled.get('message', '')}".rstrip(": ")
    name = pod.get("metadata", {}).get("name")
    mine = [e for e in events if (e.get("involvedObject") or {}).get("name") == name and e.get("type") == "Warning"]
    if mine:
        latest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return f"{latest.get('reason')}: {latest.get('message', '')}"
    waiting = [
        c["state"]["waiting"] for c in status.get("containerStatuses") or [] if (c.get("state") or {}).get("waiting")
    ]
    if waiting:
        return f"{waiting[0].get('reason', 'waiting')}: {waiting[0].get('message', '')}".rstrip(": ")
    return status.get("phase", "unknown phase")


def diagnose_pods(
    status: ClusterStatus, pods: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]] = ()
) -> str:
    """Explain a cluster that is not ready: its state, then each pod that is not ready and why.

    :param status: the cluster's status.
    :param pods: the cluster's pods.
    :param events: core/v1 events of the namespace (scheduling failures are read from them).
    """
    pods, events = list(pods), list(events)
    lines = [f"{status.phase.value}: {status.message}"]
    unready = [p for p in pods if not pod_is_ready(p)]
    for pod in sorted(unready, key=lambda p: p.get("metadata", {}).get("name", "")):
        lines.append(f"- {_pod_label(pod)}: {_pod_reason(pod, events)}")
    workers = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(NODE_TYPE_LABEL) == "worker"]
    missing = status.desired_hosts - len(workers)
    if missing > 0:
        lines.append(f"- {missing} TPU host pod(s) not created yet")
    return "\n".join(lines)


# -- RayService --------------------------------------------------------------------------------

MODEL_VERSION_KEY = "raytpu.dev/model-version"
UPDATE_KEY = "raytpu.dev/update"
APP_RUNNING = "RUNNING"
APP_DEPLOYING = "DEPLOYING"
APP_DEPLOY_FAILED = "DEPLOY_FAILED"
APP_UNHEALTHY = "UNHEALTHY"


class ServicePhase(str, Enum):
    """Where a RayService is, seen from a task waiting for one model version."""

    RUNNING = "RUNNING"
    DEPLOYING = "DEPLOYING"
    UPGRADING = "UPGRADING"
    FAILED = "FAILED"
    UNHEALTHY = "UNHEALTHY"
    GONE = "GONE"


@dataclass(frozen=True)
class DeploymentState:
    """One Serve deployment of an application, as KubeRay (or Serve) reports it.

    :param name: the deployment's name.
    :param status: UPDATING, HEALTHY, UNHEALTHY, DEPLOY_FAILED, UPSCALING or DOWNSCALING.
    :param message: Serve's message (e.g. replicas waiting to be scheduled).
    """

    name: str
    status: str
    message: str = ""


@dataclass(frozen=True)
class ApplicationState:
    """One Serve application on one of the RayService's clusters.

    :param name: the application's name.
    :param status: NOT_STARTED, DEPLOYING, RUNNING, DEPLOY_FAILED, DELETING or UNHEALTHY.
    :param message: Serve's message.
    :param cluster: ``active`` or ``pending``.
    :param deployments: its deployments.
    """

    name: str
    status: str
    message: str = ""
    cluster: str = "active"
    deployments: tuple[DeploymentState, ...] = field(default=())


@dataclass(frozen=True)
class ServiceStatus:
    """A RayService's state as the provider understands it.

    :param phase: the phase.
    :param message: one human line.
    :param requested_version: the version being waited for.
    :param spec_version: the version the RayService's spec asks for.
    :param active_cluster: the RayCluster serving traffic now.
    :param pending_cluster: the RayCluster being prepared, if any.
    :param active_version: the version the active cluster runs, when known.
    :param pending_version: the version the pending cluster is prepared for.
    :param ready: KubeRay's ``Ready`` condition (serve endpoints > 0).
    :param upgrading: KubeRay's ``UpgradeInProgress`` condition.
    :param applications: every application on the active and pending clusters.
    :param failed_application: the application that failed, when FAILED or UNHEALTHY.
    :param refresh: the status may change without a KubeRay event (an in-place update
        is confirmed through Serve itself): read it again after a while.
    """

    phase: ServicePhase
    message: str
    requested_version: str | None = None
    spec_version: str | None = None
    active_cluster: str = ""
    pending_cluster: str = ""
    active_version: str | None = None
    pending_version: str | None = None
    ready: bool = False
    upgrading: bool = False
    applications: tuple[ApplicationState, ...] = field(default=())
    failed_application: str = ""
    refresh: bool = False

    @property
    def finished(self) -> bool:
        """Whether waiting can stop: running, failed, unhealthy or deleted."""
        return self.phase in (ServicePhase.RUNNING, ServicePhase.FAILED, ServicePhase.UNHEALTHY, ServicePhase.GONE)

    @property
    def target_cluster(self) -> str:
        """The cluster that will serve the requested version: the pending one during a switch."""
        return self.pending_cluster or self.active_cluster

    def applications_on(self, cluster: str) -> tuple[ApplicationState, ...]:
        return tuple(a for a in self.applications if a.cluster == cluster)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceStatus:
        apps = tuple(
            ApplicationState(**{**a, "deployments": tuple(DeploymentState(**d) for d in a.get("deployments", ()))})
            for a in data.get("applications", ())
        )
        return cls(**{**data, "phase": ServicePhase(data["phase"]), "applications": apps})


def _template_version(cluster_spec: Mapping[str, Any] | None) -> str | None:
    template = ((cluster_spec or {}).get("headGroupSpec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(MODEL_VERSION_KEY)


def _applications(section: Mapping[str, Any], cluster: str) -> tuple[ApplicationState, ...]:
    apps = []
    for name, app in sorted((section.get("applicationStatuses") or {}).items()):
        deployments = tuple(
            DeploymentState(d_name, d.get("status", ""), d.get("message", ""))
            for d_name, d in sorted((app.get("serveDeploymentStatuses") or {}).items())
        )
        apps.append(ApplicationState(name, app.get("status", ""), app.get("message", ""), cluster, deployments))
    return tuple(apps)


def spec_applications(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The applications of a RayService's ``serveConfigV2``."""
    text = (service.get("spec") or {}).get("serveConfigV2") or ""
    try:
        config = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        return []
    apps = (config or {}).get("applications") if isinstance(config, dict) else None
    return [a for a in apps or [] if isinstance(a, dict)]


def runs_config(details: Mapping[str, Any] | None, app: Mapping[str, Any]) -> bool:
    """Whether Serve's record of an application (``GET /api/serve/applications/``) is the config ``app``, RUNNING.

    Compares the import path and the builder's args, which carry the model version.
    """
    deployed = (details or {}).get("deployed_app_config") or {}
    return (
        (details or {}).get("status", APP_RUNNING) == APP_RUNNING
        and deployed.get("import_path") == app.get("import_path")
        and (deployed.get("args") or {}) == (app.get("args") or {})
    )


def _describe_apps(apps: Iterable[ApplicationState]) -> str:
    return ", ".join(f"{a.name} {a.status}" for a in apps) or "no applications reported yet"


def _failure(app: ApplicationState) -> str:
    detail = [app.message] if app.message else []
    detail += [f"deployment {d.name!r} {d.status}: {d.message}" for d in app.deployments
               if d.status in (APP_UNHEALTHY, APP_DEPLOY_FAILED) and d.message]
    return f"application {app.name!r} is {app.status} on RayCluster {{cluster}}: " + (
        "; ".join(detail) or "no message")


def read_ray_service(
    service: Mapping[str, Any] | None,
    *,
    active_cluster: Mapping[str, Any] | None = None,
    pending_cluster: Mapping[str, Any] | None = None,
    serve_applications: Mapping[str, Any] | None = None,
    version: str | None = None,
) -> ServiceStatus:
    """Interpret a RayService for a task waiting until ``version`` serves.

    RUNNING needs all of: KubeRay has reconciled the latest spec (``observedGeneration``),
    condition ``Ready`` is True, ``UpgradeInProgress`` is not True, no pending cluster,
    the active RayCluster is the one made for the spec's ``rayClusterConfig`` (its head
    pod template carries the same version annotation), every application of the spec is
    RUNNING on it, and, after an in-place update, Serve's own record of each
    application is the spec's config. FAILED / UNHEALTHY: an application on the cluster
    that is to serve the version is DEPLOY_FAILED / UNHEALTHY (the message is Serve's).

    :param service: the RayService, ``None`` when it does not exist.
    :param active_cluster: the RayCluster named by ``activeServiceStatus.rayClusterName``.
    :param pending_cluster: the RayCluster named by ``pendingServiceStatus.rayClusterName``.
    :param serve_applications: Serve's ``applications`` (``GET /api/serve/applications/``) on
        the active cluster, when read.
    :param version: the version to wait for; default: the one the spec asks for.
    """
    if service is None:
        return ServiceStatus(ServicePhase.GONE, "the RayService does not exist", requested_version=version)
    metadata = service.get("metadata") or {}
    notes = metadata.get("annotations") or {}
    spec_version = notes.get(MODEL_VERSION_KEY)
    requested = version or spec_version
    status = service.get("status") or {}
    conditions = _conditions(status)
    ready_condition = conditions.get("Ready")
    active = status.get("activeServiceStatus") or {}
    pending = status.get("pendingServiceStatus") or {}
    active_name, pending_name = active.get("rayClusterName") or "", pending.get("rayClusterName") or ""
    spec_cluster_version = _template_version((service.get("spec") or {}).get("rayClusterConfig"))
    active_apps, pending_apps = _applications(active, "active"), _applications(pending, "pending")

    def cluster_runs(cluster: Mapping[str, Any] | None) -> str | None:
        if cluster is None:
            return None
        if _template_version(cluster.get("spec")) == spec_cluster_version:
            return spec_version
        return ((cluster.get("metadata") or {}).get("annotations") or {}).get(MODEL_VERSION_KEY) or _template_version(
            cluster.get("spec"))

    active_runs_spec = active_cluster is not None and _template_version(active_cluster.get("spec")) == spec_cluster_version
    in_place = notes.get(UPDATE_KEY) == "in-place"
    wanted = spec_applications(service)
    unconfirmed = [a["name"] for a in wanted if serve_applications is not None
                   and not runs_config((serve_applications or {}).get(a.get("name")), a)]
    confirmed = not unconfirmed and (serve_applications is not None or not in_place)
    active_version = cluster_runs(active_cluster)
    if active_runs_spec and (not confirmed or not active_apps or any(a.status != APP_RUNNING for a in active_apps)):
        active_version = None  # the spec's config has not reached it, or its replicas are being replaced
    common = {
        "requested_version": requested,
        "spec_version": spec_version,
        "active_cluster": active_name,
        "pending_cluster": pending_name,
        "active_version": active_version,
        "pending_version": cluster_runs(pending_cluster) if pending_name else None,
        "ready": _is_true(ready_condition),
        "upgrading": _is_true(conditions.get("UpgradeInProgress")),
        "applications": active_apps + pending_apps,
    }

    if metadata.get("deletionTimestamp"):
        return ServiceStatus(ServicePhase.GONE, "the RayService is being deleted", **common)
    if requested != spec_version:
        return ServiceStatus(
            ServicePhase.FAILED,
            f"the RayService now asks for version {spec_version!r}, not {requested!r}: another task promoted it",
            **common,
        )
    if ready_condition and ready_condition.get("reason") == "InitializingTimeout":
        return ServiceStatus(ServicePhase.FAILED, f"KubeRay gave up initializing: {ready_condition.get('message', '')}",
                             **common)
    target_name, target_apps = (pending_name, pending_apps) if pending_name else (active_name, active_apps)
    for bad_status, phase in ((APP_DEPLOY_FAILED, ServicePhase.FAILED), (APP_UNHEALTHY, ServicePhase.UNHEALTHY)):
        for app in target_apps:
            if app.status == bad_status and (pending_name or active_runs_spec or active_cluster is None):
                return ServiceStatus(phase, _failure(app).format(cluster=target_name), failed_application=app.name,
                                     **common)
    observed = status.get("observedGeneration")
    if observed is None or (metadata.get("generation") is not None and observed < metadata["generation"]):
        return ServiceStatus(ServicePhase.DEPLOYING, "KubeRay has not yet reconciled the latest spec", **common)
    if pending_name:
        phase = ServicePhase.UPGRADING if active_name else ServicePhase.DEPLOYING
        role = "new" if active_name else "first"
        return ServiceStatus(
            phase,
            f"preparing {role} RayCluster {pending_name} for version {requested!r}: {_describe_apps(pending_apps)}"
            + (f"; RayCluster {active_name} keeps serving" if active_name else ""),
            **common,
        )
    if not active_name:
        return ServiceStatus(ServicePhase.DEPLOYING, "KubeRay has not created a RayCluster yet", **common)
    if active_cluster is None:
        return ServiceStatus(ServicePhase.DEPLOYING, f"the active RayCluster {active_name} cannot be read", **common)
    if not active_runs_spec:
        return ServiceStatus(
            ServicePhase.UPGRADING,
            f"RayCluster {active_name} serves version {active_version!r}; KubeRay has not started a cluster for "
            f"version {requested!r} yet",
            **common,
        )
    reported = {a.name: a for a in active_apps}
    missing = [a.get("name") for a in wanted if a.get("name") not in reported]
    waiting = [a for a in active_apps if a.status != APP_RUNNING]
    if missing or waiting or not active_apps:
        text = _describe_apps(waiting) if waiting else "no applications reported yet"
        if missing:
            text += f"; not reported yet: {', '.join(missing)}"
        return ServiceStatus(ServicePhase.DEPLOYING, f"on RayCluster {active_name}: {text}", **common)
    if not confirmed:
        detail = (f"Serve does not run the spec's config of {', '.join(unconfirmed)} yet" if unconfirmed
                  else "waiting for Serve to confirm the in-place update")
        return ServiceStatus(ServicePhase.DEPLOYING, f"on RayCluster {active_name}: {detail}", refresh=True, **common)
    if not _is_true(ready_condition):
        reason = (ready_condition or {}).get("reason", "no Ready condition yet")
        return ServiceStatus(ServicePhase.DEPLOYING, f"no serve endpoints ready yet ({reason})", **common)
    if _is_true(conditions.get("UpgradeInProgress")):
        return ServiceStatus(ServicePhase.UPGRADING, "KubeRay reports an upgrade in progress", **common)
    return ServiceStatus(
        ServicePhase.RUNNING,
        f"version {requested!r} serving on RayCluster {active_name}: {_describe_apps(active_apps)}",
        **common,
    )


def describe_replicas(details: Mapping[str, Any]) -> list[str]:
    """Replicas waiting to start, per deployment, from Serve's record of one application.

    Serve lists replicas without their version: during a rollout a RUNNING replica may be the
    previous version's, kept while the new ones wait, so waiting ones are counted, not
    RUNNING against the target.
    """
    lines = []
    for name, deployment in sorted((details.get("deployments") or {}).items()):
        states: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            states[replica.get("state", "?")] = states.get(replica.get("state", "?"), 0) + 1
        running = states.get("RUNNING", 0)
        starting = {s: n for s, n in states.items() if s not in ("RUNNING", "STOPPING")}
        target = deployment.get("target_num_replicas")
        missing = max(0, (target or 0) - running - sum(starting.values()))
        waiting = sum(starting.values()) + missing
        if waiting <= 0:
            continue
        parts = [f"{n} {s}" for s, n in sorted(starting.items())] + ([f"{missing} not created yet"] if missing else [])
        resources = deployment.get("required_resources")
        lines.append(
            f"deployment {name!r}: {waiting} replica(s) waiting to start ({', '.join(parts)}), {running} RUNNING, "
            f"{target} wanted" + (f"; each replica needs {json.dumps(resources, sort_keys=True)}" if resources else "")
        )
    return lines


def diagnose_ray_service(
    status: ServiceStatus,
    *,
    waited: float | None = None,
    serve_applications: Mapping[str, Any] | None = None,
    cluster_diagnosis: str = "",
    config_problems: Iterable[str] = (),
) -> str:
    """Explain a RayService that is not serving the requested version.

    Lists each application that is not RUNNING on the cluster meant to serve it with each
    deployment's message (Serve says how many replicas wait to be scheduled), the replica
    counts when Serve was read, the state of that cluster's slices, and anything in the
    Serve config that cannot be scheduled on one slice (a missing TPU topology).

    :param status: the service's status.
    :param waited: how long the application has been deploying, in seconds.
    :param serve_applications: Serve's ``applications`` on the cluster, when read.
    :param cluster_diagnosis: :meth:`ClusterBackend.diagnose` of that cluster.
    :param config_problems: problems found in the Serve config, one line each.
    """
    target = status.target_cluster
    role = "pending" if status.pending_cluster else "active"
    head = f"{status.phase.value}: {status.message}"
    if waited is not None:
        head = f"{head} (deploying for {waited:.0f} s)"
    lines = [head]
    for app in status.applications_on(role):
        if app.status == APP_RUNNING:
            continue
        lines.append(f"- application {app.name!r} {app.status} on {role} RayCluster {target}"
                     + (f": {app.message}" if app.message else ""))
        for deployment in app.deployments:
            if deployment.status != "HEALTHY":
                lines.append(f"  - deployment {deployment.name!r} {deployment.status}"
                             + (f": {deployment.message}" if deployment.message else ""))
        for line in describe_replicas((serve_applications or {}).get(app.name) or {}):
            lines.append(f"  - {line}")
    if cluster_diagnosis:
        lines.append(f"RayCluster {target or '(none yet)'} ({role}):")
        lines.extend(f"  {line}" for line in cluster_diagnosis.splitlines())
    problems = list(config_problems)
    if problems:
        lines.append("Serve config problems (a replica that cannot land on one slice waits forever):")
        lines.extend(f"- {p}" for p in problems)
    else:
        lines.append("Serve config: every multi-host replica declares its slice topology or its bundles")
    return "\n".join(lines)
