"""RayServices on the local backend: a local RayCluster plus Serve's REST API, as KubeRay does it.

A RayService here is the local RayCluster made from its ``rayClusterConfig`` (through
the local backend's own :meth:`apply_cluster`) and its ``serveConfigV2`` PUT to the Serve
REST API of that cluster's dashboard (``PUT /api/serve/applications/``, the call KubeRay
makes; :mod:`~airflow_provider_raytpu.backends.local.serve_sync`). A promotion PUTs the
new config on the same cluster: Serve redeploys the changed applications
(``max_surge_percent`` in a deployment's options makes new replicas start before old ones
stop). Applying submits the config once the head is ready; the cluster's supervisor submits
it again whenever Serve lacks it (a head that was not ready in time, a restarted head).
Status is Serve's ``GET /api/serve/applications/``, dressed as a RayService status and read
by :func:`~airflow_provider_raytpu.status.read_ray_service`, so RUNNING / DEPLOYING /
FAILED mean the same as on Kubernetes; a version counts as running only once Serve's record
of every application (``deployed_app_config``) is the spec's. Reading status writes nothing.

Locally the Serve HTTP proxy runs on the head only (``proxy_location: HeadOnly``: every
emulated host is on this machine) and listens on a free port chosen once per service.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import shutil
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.backends.apply import (
    SERVICE_OWNER,
    ObjectStore,
    OnChange,
    apply_object,
    same_service,
    same_spec,
)
from airflow_provider_raytpu.backends.base import ApplyResult, ChangedSinceChecked, Precondition, ServiceBackend
from airflow_provider_raytpu.backends.local.process import free_port, read_json, write_json_atomic
from airflow_provider_raytpu.backends.local.selectors import selector_matches
from airflow_provider_raytpu.backends.local.serve_sync import (
    SERVE_STATE_FILE,
    SERVICE_FILE,
    service_lock,
    sync_serve_config,
)
from airflow_provider_raytpu.backends.local.state import service_dir, services_dir, stored_form
from airflow_provider_raytpu.dashboard.serve import serve_details
from airflow_provider_raytpu.dashboard.transport import DirectTransport, HttpTransport
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.manifests.rayservice import ray_cluster_of, service_config_problems
from airflow_provider_raytpu.manifests.serveconfig import parse_serve_config
from airflow_provider_raytpu.status import Phase, ServiceStatus, diagnose_ray_service, read_ray_service

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend

log = logging.getLogger(__name__)

CLUSTER_SUFFIX = "-local"
HEAD_WAIT_SECONDS = 180.0
SERVE_POLL_SECONDS = 1.0


def local_cluster_name(service_name: str) -> str:
    """The local RayCluster that runs a RayService (KubeRay's are ``<name>-<random>``; here one, stable)."""
    return f"{service_name}{CLUSTER_SUFFIX}"


class _ServiceFiles(ObjectStore):
    """A local RayService's ``rayservice.json`` as the :class:`~airflow_provider_raytpu.backends.apply.ObjectStore`
    of :func:`~airflow_provider_raytpu.backends.apply.apply_object`. Used under the service's lock, so
    neither raises ``AlreadyExists`` nor ``StaleWrite``.

    :param path: the service's directory.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        service: dict[str, Any] | None = read_json(self.path / SERVICE_FILE)
        return service

    def _write(self, service: dict[str, Any]) -> dict[str, Any]:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / SERVICE_FILE, service)
        return service

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self._write(stored_form(manifest, None))

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        existing = self.get(manifest["metadata"]["name"], manifest["metadata"]["namespace"])
        changed = existing is None or not same_spec(existing, manifest)
        return self._write(stored_form(manifest, existing, changed=changed))


class LocalServices(ServiceBackend):
    """RayServices on the local backend, each on a local RayCluster of the
    :class:`~airflow_provider_raytpu.backends.local.LocalBackend`.

    :param clusters: the local backend that runs the services' clusters.
    :param home: where it keeps its records.
    """

    def __init__(self, clusters: ClusterBackend, home: Path) -> None:
        self.clusters = clusters
        self.home = home

    # -- files --------------------------------------------------------------------------------

    def service_dir(self, name: str, namespace: str) -> Path:
        """Where the RayService is recorded (whether or not it exists)."""
        return service_dir(self.home, name, namespace)

    def _stored(self, name: str, namespace: str) -> dict[str, Any] | None:
        service: dict[str, Any] | None = read_json(self.service_dir(name, namespace) / SERVICE_FILE)
        return service

    def _serve_state(self, name: str, namespace: str) -> dict[str, Any]:
        return read_json(self.service_dir(name, namespace) / SERVE_STATE_FILE) or {}

    # -- apply / delete -----------------------------------------------------------------------

    def apply_service(self, manifest: dict[str, Any]) -> ApplyResult:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        path = self.service_dir(name, namespace)
        with service_lock(path):
            applied = apply_object(_ServiceFiles(path), manifest, same=same_service, owner=SERVICE_OWNER,
                                   on_change=OnChange.REPLACE)
            stored = applied.cluster
            state = self._serve_state(name, namespace)
            if "serve_port" not in state:
                write_json_atomic(path / SERVE_STATE_FILE, {**state, "serve_port": free_port()})
            cluster = ray_cluster_of(stored, local_cluster_name(name))
            # A changed rayClusterConfig (image, resources, slice) restarts the local cluster.
            self.clusters.apply_cluster(cluster, update_if_exists=True)
            if self._wait_for_head(name, namespace):
                sync_serve_config(path, self.clusters.dashboard(local_cluster_name(name), namespace))
        return ApplyResult(applied.action, self.get_service(name, namespace) or stored)

    def _wait_for_head(self, name: str, namespace: str, timeout: float = HEAD_WAIT_SECONDS) -> bool:
        """Wait (bounded) until the cluster's head is ready, so the Serve config can be PUT now.

        If it is not ready in time, the cluster's supervisor submits the config once it is
        (as KubeRay's next reconcile would).
        """
        deadline = time.monotonic() + timeout
        cluster = local_cluster_name(name)
        while time.monotonic() < deadline:
            status = self.clusters.cluster_status(cluster, namespace)
            if status.head_ready:
                return True
            if status.phase in (Phase.FAILED, Phase.GONE):
                return False
            time.sleep(0.5)
        log.warning("The head of local RayCluster %s/%s is not ready after %.0f s; its supervisor submits the "
                    "Serve config once it is", namespace, cluster, timeout)
        return False

    def delete_service(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        with service_lock(self.service_dir(name, namespace)):
            stored = self._stored(name, namespace)
            if stored is not None and precondition is not None and (unmet := precondition.unmet(stored)):
                raise ChangedSinceChecked("RayService", name, namespace, unmet)
            cluster_gone = not self.clusters.delete_cluster(local_cluster_name(name), namespace)
            shutil.rmtree(self.service_dir(name, namespace), ignore_errors=True)
        return stored is not None or not cluster_gone

    def list_services(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        root = services_dir(self.home, namespace)
        found = []
        for path in sorted(root.glob(f"*/{SERVICE_FILE}")) if root.is_dir() else []:
            stored = read_json(path)
            if stored and selector_matches((stored.get("metadata") or {}).get("labels") or {}, label_selector):
                found.append(self.get_service(path.parent.name, namespace) or stored)
        return found

    # -- Serve --------------------------------------------------------------------------------

    def _dashboard(self, name: str, namespace: str) -> HttpTransport | None:
        cluster = local_cluster_name(name)
        if not self.clusters.cluster_status(cluster, namespace).head_ready:
            return None
        try:
            return self.clusters.dashboard(cluster, namespace)
        except FatalError:
            return None

    def serve_details(self, name: str, namespace: str) -> dict[str, Any] | None:
        """Serve's ``GET /api/serve/applications/`` on the service's cluster; ``None`` when unreachable."""
        dashboard = self._dashboard(name, namespace)
        if dashboard is None:
            return None
        return serve_details(dashboard, f"local RayService {namespace}/{name}")

    # -- status -------------------------------------------------------------------------------

    def _synthesise(self, name: str, namespace: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                              dict[str, Any] | None]:
        """The RayService with a KubeRay-like status, its (active) cluster, and Serve's applications."""
        stored = self._stored(name, namespace)
        if stored is None:
            return None, None, None
        service = copy.deepcopy(stored)
        state = self._serve_state(name, namespace)
        cluster_name = local_cluster_name(name)
        cluster = self.clusters.get_cluster(cluster_name, namespace)
        details = self.serve_details(name, namespace) if cluster is not None else None
        applications = (details or {}).get("applications") or {}
        statuses = {
            app: {
                "status": info.get("status", ""),
                "message": info.get("message", ""),
                "serveDeploymentStatuses": {
                    dep: {"status": d.get("status", ""), "message": d.get("message", "")}
                    for dep, d in (info.get("deployments") or {}).items()
                },
            }
            for app, info in applications.items()
        }
        if state.get("submit_error") and state.get("submitted_generation") == stored["metadata"]["generation"]:
            for app in parse_serve_config(stored["spec"].get("serveConfigV2")).get("applications") or []:
                statuses[app.get("name", "?")] = {"status": "DEPLOY_FAILED",
                                                  "message": f"Serve refused the config: {state['submit_error']}"}
        proxies = (details or {}).get("proxies") or {}
        serving = any((p or {}).get("status") == "HEALTHY" for p in proxies.values()) and bool(statuses)
        service["status"] = {
            "observedGeneration": stored["metadata"]["generation"],
            "conditions": [
                {"type": "Ready", "status": "True" if serving else "False",
                 "reason": "NonZeroServeEndpoints" if serving else "ZeroServeEndpoints"},
                {"type": "UpgradeInProgress", "status": "False", "reason": "NoPendingCluster"},
            ],
            "activeServiceStatus": {"rayClusterName": cluster_name, "applicationStatuses": statuses}
            if cluster is not None else {},
        }
        active = {"metadata": {"name": cluster_name, "namespace": namespace},
                  "spec": (stored.get("spec") or {}).get("rayClusterConfig") or {}} if cluster is not None else None
        return service, active, applications if details is not None else None

    def get_service(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self._synthesise(name, namespace)[0]

    def service_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        service, active, applications = self._synthesise(name, namespace)
        if service is not None and active is None:
            status = read_ray_service(service, version=version)
            cluster = self.clusters.cluster_status(local_cluster_name(name), namespace)
            return ServiceStatus(**{**status.__dict__, "message": f"local RayCluster: {cluster.message}"})
        return read_ray_service(service, active_cluster=active, serve_applications=applications, version=version)

    async def aservice_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        return await asyncio.to_thread(self.service_status, name, namespace, version)

    async def watch_service(
        self, name: str, namespace: str, version: str | None = None, poll_interval: float = SERVE_POLL_SECONDS
    ) -> AsyncGenerator[ServiceStatus, None]:
        """Yield the status now and whenever it changes.

        There is no watch API locally: Serve's REST API is polled every
        ``min(poll_interval, 1)`` seconds.
        """
        interval = min(poll_interval, SERVE_POLL_SECONDS)
        last: ServiceStatus | None = None
        while True:
            status = await self.aservice_status(name, namespace, version)
            if status != last:
                last = status
                yield status
            await asyncio.sleep(interval)

    def diagnose_service(self, name: str, namespace: str, version: str | None = None,
                         waited: float | None = None) -> str:
        status = self.service_status(name, namespace, version)
        service, _, applications = self._synthesise(name, namespace)
        if service is None:
            return status.message
        return diagnose_ray_service(
            status,
            waited=waited,
            serve_applications=applications,
            cluster_diagnosis=self.clusters.diagnose_cluster(local_cluster_name(name), namespace),
            config_problems=service_config_problems(service),
        )

    async def adiagnose_service(self, name: str, namespace: str, version: str | None = None,
                                waited: float | None = None) -> str:
        return await asyncio.to_thread(self.diagnose_service, name, namespace, version, waited)

    # -- HTTP ---------------------------------------------------------------------------------

    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The dashboard of the service's local RayCluster."""
        return self.clusters.dashboard(local_cluster_name(name), namespace)

    def serve_endpoint(self, name: str, namespace: str) -> HttpTransport:
        """The Serve HTTP proxy on the service's head, ``http://127.0.0.1:<port>``."""
        state = self._serve_state(name, namespace)
        if "serve_port" not in state:
            raise FatalError(f"RayService {name!r} does not exist in namespace {namespace!r} on the local backend")
        return DirectTransport(f"http://127.0.0.1:{state['serve_port']}")
