"""A RayService's status, read for a task waiting until one model version serves.

A RayService is RUNNING for a model version only when its ACTIVE cluster is the one
made for that version (see :func:`read_ray_service`): during a switch the old cluster
keeps serving, Ready and RUNNING, and must not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import yaml

from airflow_provider_raytpu.status.conditions import conditions, is_true
from airflow_provider_raytpu.status.plain import plain_fields

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
        """Whether waiting can stop: running, failed or deleted (Serve may recover an UNHEALTHY application)."""
        return self.phase in (ServicePhase.RUNNING, ServicePhase.FAILED, ServicePhase.GONE)

    @property
    def target_cluster(self) -> str:
        """The cluster that will serve the requested version: the pending one during a switch."""
        return self.pending_cluster or self.active_cluster

    def applications_on(self, cluster: str) -> tuple[ApplicationState, ...]:
        return tuple(a for a in self.applications if a.cluster == cluster)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (lists, not tuples): the sensor returns it as its XCom."""
        return plain_fields(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceStatus:
        apps = tuple(
            ApplicationState(**{**a, "deployments": tuple(DeploymentState(**d) for d in a.get("deployments", ()))})
            for a in data.get("applications", ())
        )
        return cls(**{**data, "phase": ServicePhase(data["phase"]), "applications": apps})


def spec_applications(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The applications of a RayService's ``serveConfigV2``."""
    text = (service.get("spec") or {}).get("serveConfigV2") or ""
    try:
        config = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        return []
    apps = (config or {}).get("applications") if isinstance(config, dict) else None
    return [a for a in apps or [] if isinstance(a, dict)]


def _app_name(app: Mapping[str, Any]) -> Any:
    """An application's ``name`` in the spec's YAML: any YAML value, ``None`` when it has none."""
    return app.get("name")


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
    that is to serve the version is DEPLOY_FAILED (final) / UNHEALTHY (Serve may recover it:
    the waiter decides how long to wait) (the message is Serve's).

    :param service: the RayService, ``None`` when it does not exist.
    :param active_cluster: the RayCluster named by ``activeServiceStatus.rayClusterName``.
    :param pending_cluster: the RayCluster named by ``pendingServiceStatus.rayClusterName``.
    :param serve_applications: Serve's ``applications`` (``GET /api/serve/applications/``) on
        the active cluster, when read.
    :param version: the version to wait for; default: the one the spec asks for.
    """
    if service is None:
        return ServiceStatus(ServicePhase.GONE, "the RayService does not exist", requested_version=version)
    seen = _observe(service, active_cluster, pending_cluster, serve_applications, version)
    return _ended(seen) or _switching_clusters(seen) or _serving(seen)


@dataclass(frozen=True)
class _Observed:
    """What a RayService, its clusters and Serve say, gathered once and then judged in order."""

    deleting: bool
    requested: str | None
    spec_version: str | None
    reconciled: bool
    ready_condition: Mapping[str, Any] | None
    upgrading: bool
    active_name: str
    pending_name: str
    active_apps: tuple[ApplicationState, ...]
    pending_apps: tuple[ApplicationState, ...]
    active_read: bool
    active_runs_spec: bool
    active_version: str | None
    pending_version: str | None
    #: names of the spec's applications Serve does not report, as the spec's YAML gives them (``None`` when unnamed)
    missing: list[Any]
    unconfirmed: list[str]
    confirmed: bool

    def status(self, phase: ServicePhase, message: str, *, failed_application: str = "",
               refresh: bool = False) -> ServiceStatus:
        return ServiceStatus(
            phase,
            message,
            requested_version=self.requested,
            spec_version=self.spec_version,
            active_cluster=self.active_name,
            pending_cluster=self.pending_name,
            active_version=self.active_version,
            pending_version=self.pending_version,
            ready=is_true(self.ready_condition),
            upgrading=self.upgrading,
            applications=self.active_apps + self.pending_apps,
            failed_application=failed_application,
            refresh=refresh,
        )


def _observe(
    service: Mapping[str, Any],
    active_cluster: Mapping[str, Any] | None,
    pending_cluster: Mapping[str, Any] | None,
    serve_applications: Mapping[str, Any] | None,
    version: str | None,
) -> _Observed:
    metadata = service.get("metadata") or {}
    notes = metadata.get("annotations") or {}
    spec_version = notes.get(MODEL_VERSION_KEY)
    status = service.get("status") or {}
    by_type = conditions(status)
    active = status.get("activeServiceStatus") or {}
    pending = status.get("pendingServiceStatus") or {}
    pending_name = pending.get("rayClusterName") or ""
    active_apps = _applications(active, "active")
    spec_cluster = _template_version((service.get("spec") or {}).get("rayClusterConfig"))
    active_runs_spec = active_cluster is not None and _template_version(active_cluster.get("spec")) == spec_cluster

    wanted = spec_applications(service)
    unconfirmed = [] if serve_applications is None else [
        a["name"] for a in wanted if not runs_config(serve_applications.get(_app_name(a)), a)]
    confirmed = not unconfirmed and (serve_applications is not None or notes.get(UPDATE_KEY) != "in-place")
    active_version = _cluster_version(active_cluster, spec_cluster, spec_version)
    if active_runs_spec and (not confirmed or not active_apps or any(a.status != APP_RUNNING for a in active_apps)):
        active_version = None  # the spec's config has not reached it, or its replicas are being replaced
    reported = {a.name for a in active_apps}
    observed, generation = status.get("observedGeneration"), metadata.get("generation")
    return _Observed(
        deleting=bool(metadata.get("deletionTimestamp")),
        requested=version or spec_version,
        spec_version=spec_version,
        reconciled=not (observed is None or (generation is not None and observed < generation)),
        ready_condition=by_type.get("Ready"),
        upgrading=is_true(by_type.get("UpgradeInProgress")),
        active_name=active.get("rayClusterName") or "",
        pending_name=pending_name,
        active_apps=active_apps,
        pending_apps=_applications(pending, "pending"),
        active_read=active_cluster is not None,
        active_runs_spec=active_runs_spec,
        active_version=active_version,
        pending_version=_cluster_version(pending_cluster, spec_cluster, spec_version) if pending_name else None,
        missing=[_app_name(a) for a in wanted if _app_name(a) not in reported],
        unconfirmed=unconfirmed,
        confirmed=confirmed,
    )


def _ended(seen: _Observed) -> ServiceStatus | None:
    """Waiting is over without success: the service is going, was promoted again, or failed."""
    if seen.deleting:
        return seen.status(ServicePhase.GONE, "the RayService is being deleted")
    if seen.requested != seen.spec_version:
        return seen.status(
            ServicePhase.FAILED,
            f"the RayService now asks for version {seen.spec_version!r}, not {seen.requested!r}: "
            "another task promoted it",
        )
    ready = seen.ready_condition
    if ready and ready.get("reason") == "InitializingTimeout":
        return seen.status(ServicePhase.FAILED, f"KubeRay gave up initializing: {ready.get('message', '')}")
    if not seen.pending_name and seen.active_read and not seen.active_runs_spec:
        return None  # the active cluster runs another version: its troubles are not this version's
    target, apps = (seen.pending_name, seen.pending_apps) if seen.pending_name else (seen.active_name, seen.active_apps)
    for bad_status, phase in ((APP_DEPLOY_FAILED, ServicePhase.FAILED), (APP_UNHEALTHY, ServicePhase.UNHEALTHY)):
        for app in apps:
            if app.status == bad_status:
                return seen.status(phase, _failure(app, target), failed_application=app.name)
    return None


def _switching_clusters(seen: _Observed) -> ServiceStatus | None:
    """Still on the way to an active cluster made for the spec: KubeRay reconciling, preparing or switching."""
    if not seen.reconciled:
        return seen.status(ServicePhase.DEPLOYING, "KubeRay has not yet reconciled the latest spec")
    active, pending = seen.active_name, seen.pending_name
    if pending:
        return seen.status(
            ServicePhase.UPGRADING if active else ServicePhase.DEPLOYING,
            f"preparing {'new' if active else 'first'} RayCluster {pending} for version {seen.requested!r}: "
            f"{_describe_apps(seen.pending_apps)}" + (f"; RayCluster {active} keeps serving" if active else ""),
        )
    if not active:
        return seen.status(ServicePhase.DEPLOYING, "KubeRay has not created a RayCluster yet")
    if not seen.active_read:
        return seen.status(ServicePhase.DEPLOYING, f"the active RayCluster {active} cannot be read")
    if not seen.active_runs_spec:
        return seen.status(
            ServicePhase.UPGRADING,
            f"RayCluster {active} serves version {seen.active_version!r}; KubeRay has not started a cluster for "
            f"version {seen.requested!r} yet",
        )
    return None


def _serving(seen: _Observed) -> ServiceStatus:
    """The active cluster is the spec's: RUNNING once Serve and KubeRay both say its applications serve."""
    active = seen.active_name
    waiting = [a for a in seen.active_apps if a.status != APP_RUNNING]
    if seen.missing or waiting or not seen.active_apps:
        text = _describe_apps(waiting) if waiting else "no applications reported yet"
        if seen.missing:
            text += f"; not reported yet: {', '.join(seen.missing)}"
        return seen.status(ServicePhase.DEPLOYING, f"on RayCluster {active}: {text}")
    if not seen.confirmed:
        detail = (f"Serve does not run the spec's config of {', '.join(seen.unconfirmed)} yet" if seen.unconfirmed
                  else "waiting for Serve to confirm the in-place update")
        return seen.status(ServicePhase.DEPLOYING, f"on RayCluster {active}: {detail}", refresh=True)
    if not is_true(seen.ready_condition):
        reason = (seen.ready_condition or {}).get("reason", "no Ready condition yet")
        return seen.status(ServicePhase.DEPLOYING, f"no serve endpoints ready yet ({reason})")
    if seen.upgrading:
        return seen.status(ServicePhase.UPGRADING, "KubeRay reports an upgrade in progress")
    return seen.status(
        ServicePhase.RUNNING, f"version {seen.requested!r} serving on RayCluster {active}: "
        f"{_describe_apps(seen.active_apps)}"
    )


def _template_version(cluster_spec: Mapping[str, Any] | None) -> str | None:
    template = ((cluster_spec or {}).get("headGroupSpec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(MODEL_VERSION_KEY)


def _cluster_version(
    cluster: Mapping[str, Any] | None, spec_cluster: str | None, spec_version: str | None
) -> str | None:
    """The version a RayCluster of the service runs: the spec's when it was made from the spec's cluster config."""
    if cluster is None:
        return None
    if _template_version(cluster.get("spec")) == spec_cluster:
        return spec_version
    return ((cluster.get("metadata") or {}).get("annotations") or {}).get(MODEL_VERSION_KEY) or _template_version(
        cluster.get("spec"))


def _applications(section: Mapping[str, Any], cluster: str) -> tuple[ApplicationState, ...]:
    apps = []
    for name, app in sorted((section.get("applicationStatuses") or {}).items()):
        deployments = tuple(
            DeploymentState(d_name, d.get("status", ""), d.get("message", ""))
            for d_name, d in sorted((app.get("serveDeploymentStatuses") or {}).items())
        )
        apps.append(ApplicationState(name, app.get("status", ""), app.get("message", ""), cluster, deployments))
    return tuple(apps)


def _describe_apps(apps: Iterable[ApplicationState]) -> str:
    return ", ".join(f"{a.name} {a.status}" for a in apps) or "no applications reported yet"


def _failure(app: ApplicationState, cluster: str) -> str:
    detail = [app.message] if app.message else []
    detail += [f"deployment {d.name!r} {d.status}: {d.message}" for d in app.deployments
               if d.status in (APP_UNHEALTHY, APP_DEPLOY_FAILED) and d.message]
    return f"application {app.name!r} is {app.status} on RayCluster {cluster}: " + ("; ".join(detail) or "no message")
