"""Put a local RayService's Serve config on its cluster, as KubeRay's reconcile does.

The spec's ``serveConfigV2`` is PUT to ``/api/serve/applications/`` on the cluster's
dashboard when Serve has not got this generation of it yet, or has lost it (a restarted
head starts with an empty Serve). Two callers, never a status read: applying the service
(:mod:`airflow_provider_raytpu.backends.local.serve`), and the supervisor of the service's
cluster (:mod:`airflow_provider_raytpu.backends.local.supervisor`), the local stand-in for
the KubeRay operator, which checks every few seconds while the head runs. A service's
``serve.json`` records its Serve port, the generation last submitted and Serve's refusal.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.process import file_lock, read_json, write_json_atomic
from airflow_provider_raytpu.backends.local.state import SERVICES_DIR, home_of
from airflow_provider_raytpu.dashboard.serve import SERVE_APPLICATIONS_ENDPOINT, serve_details
from airflow_provider_raytpu.dashboard.transport import HttpTransport
from airflow_provider_raytpu.manifests.raycluster import ORIGINATED_FROM_LABEL
from airflow_provider_raytpu.manifests.serveconfig import parse_serve_config

log = logging.getLogger(__name__)

SERVICE_FILE = "rayservice.json"
SERVE_STATE_FILE = "serve.json"
PICKUP_SECONDS = 5.0
SUBMIT_TIMEOUT_SECONDS = 60.0


@contextlib.contextmanager
def service_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold the RayService's lock (apply, delete and Serve submissions of one service are serialised).

    :param path: the service's directory.
    :param wait: wait for it; with ``False`` yield ``False`` at once when someone holds it.
    """
    with file_lock(path.parent / f".{path.name}.lock", wait=wait) as locked:
        yield locked


def service_dir_of(cluster_path: Path, manifest: Mapping[str, Any]) -> Path | None:
    """The directory of the RayService a local cluster runs, or ``None`` for a plain RayCluster.

    :param cluster_path: the cluster's state directory.
    :param manifest: the cluster's stored manifest (a service's cluster names it in a label).
    """
    metadata = manifest.get("metadata") or {}
    service: str | None = (metadata.get("labels") or {}).get(ORIGINATED_FROM_LABEL)
    if not service:
        return None
    namespace: str = metadata.get("namespace", "default")
    return home_of(cluster_path) / SERVICES_DIR / namespace / service


def submitted_config(service: Mapping[str, Any], serve_port: int) -> dict[str, Any]:
    """The Serve config KubeRay would PUT, with a local HTTP proxy on the head only."""
    config = parse_serve_config((service.get("spec") or {}).get("serveConfigV2"))
    http_options = dict(config.get("http_options") or {})
    http_options.update({"host": "127.0.0.1", "port": serve_port})
    return {**config, "http_options": http_options, "proxy_location": "HeadOnly"}


def _app_states(dashboard: HttpTransport, where: str) -> dict[str, tuple[str, str]]:
    details = serve_details(dashboard, where) or {}
    return {app: (info.get("status", ""), info.get("message", ""))
            for app, info in (details.get("applications") or {}).items()}


def _await_pickup(dashboard: HttpTransport, where: str, apps: list[Any], before: dict[str, tuple[str, str]],
                  timeout: float = PICKUP_SECONDS) -> None:
    """Wait until Serve's controller has taken up a config it accepted.

    Serve stores a PUT config at once but changes the applications' status in its next
    control loop, so until then the previous config's status (RUNNING, or DEPLOY_FAILED
    of a broken version) would be read as the new one's.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _app_states(dashboard, where)
        if all(app in now and now[app] != before.get(app) for app in apps):
            return
        time.sleep(0.1)


def sync_serve_config(path: Path, dashboard: HttpTransport) -> None:
    """PUT the spec's Serve config when Serve has not got it yet (or lost it). The caller holds the service's lock.

    :param path: the service's directory.
    :param dashboard: the dashboard of the service's cluster, whose head is ready.
    """
    service = read_json(path / SERVICE_FILE)
    if service is None:
        return
    where = f"local RayService {service['metadata'].get('namespace')}/{service['metadata'].get('name')}"
    state = read_json(path / SERVE_STATE_FILE) or {}
    generation = service["metadata"]["generation"]
    if state.get("submitted_generation") == generation:
        details = serve_details(dashboard, where)
        if details is None or (details.get("applications") or {}):
            return
        log.info("Serve of %s has no applications (head restarted?); submitting again", where)
    config = submitted_config(service, int(state["serve_port"]))
    before = _app_states(dashboard, where)
    try:
        answer = dashboard.request("PUT", SERVE_APPLICATIONS_ENDPOINT, json=config, timeout=SUBMIT_TIMEOUT_SECONDS)
    except OSError as exc:  # the dashboard restarts: the cluster's supervisor submits it again
        log.warning("Could not submit the Serve config of %s: %s", where, exc)
        return
    if answer.ok:
        _await_pickup(dashboard, where, [a.get("name") for a in config.get("applications") or []], before)
        state.pop("submit_error", None)
        log.info("Submitted the Serve config of %s (generation %s)", where, generation)
    else:
        # Serve refused the config (e.g. an invalid field): record it as a failed deploy.
        state["submit_error"] = answer.text(2000)
        log.warning("Serve refused the config of %s (%s): %s", where, answer.status, state["submit_error"])
    state["submitted_generation"] = generation
    write_json_atomic(path / SERVE_STATE_FILE, state)


def keep_serve_config(path: Path, dashboard: HttpTransport) -> None:
    """:func:`sync_serve_config` unless the service is being applied or deleted right now (then that does it).

    :param path: the service's directory.
    :param dashboard: the dashboard of the service's cluster, whose head is ready.
    """
    if not path.is_dir():
        return
    with service_lock(path, wait=False) as locked:
        if locked:
            sync_serve_config(path, dashboard)
