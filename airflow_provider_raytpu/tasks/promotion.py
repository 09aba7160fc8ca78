"""Promoting a RayService's versions: applying one with progress lines, rolling back to the one before, and the
service reference later tasks take. Shared by the deploy and rollback operators."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.backends.apply import annotations_of, describe_owner, is_managed
from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.errors import ConflictError, InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import DAG_ID_KEY, DEPLOYMENT_KEY, AirflowOrigin, tpu_slice_of
from airflow_provider_raytpu.manifests.rayservice import (
    UPDATE_ANNOTATION,
    rolled_back_by,
    rolled_back_service,
    service_version,
    version_history,
)
from airflow_provider_raytpu.progress import progress
from airflow_provider_raytpu.status import spec_applications
from airflow_provider_raytpu.tasks.base import CONN_KEY, ServiceTaskMixin, origin_of
from airflow_provider_raytpu.tasks.links import push_service_links

if TYPE_CHECKING:
    from airflow.sdk import Context


def previous_version(history: Sequence[str], version: str) -> str | None:
    """The newest version in the history other than ``version``."""
    return next((v for v in reversed(history) if v != version), None)


def applied(action: Applied, update: str) -> str:
    """What applying a RayService did, in words: ``created``, ``updated (new-cluster)``, ``adopted: ...``."""
    if action is Applied.ADOPTED:
        return "adopted: it already has this spec and version, nothing changed"
    if action is Applied.CREATED:
        return "created"
    return f"updated ({update})"


def apply_logged(task: ServiceTaskMixin, context: Context, manifest: dict[str, Any]) -> None:
    """Apply a RayService manifest, with progress lines while the apply blocks (a promotion waits for
    its serving cluster's head); say what happened and push the task's Serve links."""
    backend, log = task.service_backend, task.log
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    version = service_version(manifest)
    with progress(log, f"Applying version {version!r} to RayService {namespace}/{name}",
                  lambda: backend.service_status(name, namespace, version).message):
        result = backend.apply_service(manifest)
    log.info("RayService %s/%s %s", namespace, name,
             applied(result.action, manifest["metadata"]["annotations"][UPDATE_ANNOTATION]))
    push_service_links(context, backend, name, namespace, result.cluster)
    log.info("%s", endpoint_line(backend.serve_endpoint(name, namespace).url, spec_applications(manifest)))


def endpoint_line(url: str, applications: Sequence[Mapping[str, Any]]) -> str:
    """Where a RayService's applications answer, and how to call them, for the deploy task's log.

    :param url: the Serve endpoint as the backend reaches it.
    :param applications: the Serve config's applications (``name``, ``route_prefix``).
    """
    base = url.rstrip("/")
    routes = ", ".join(f"{app.get('name')} at {base}{app.get('route_prefix') or '/'}" for app in applications)
    return (f"Serve endpoint: {routes or url}. Send each application what it takes (e.g. a POST with a JSON body); "
            "a browser's GET of it is not a call. RayServiceRunningSensor's smoke_request can make one")


def service_reference(task: ServiceTaskMixin, service: dict[str, Any]) -> dict[str, Any]:
    """The reference every later task takes, for a RayService as applied (no secrets in it)."""
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    version = service_version(service)
    tpu = tpu_slice_of(service)
    return {
        "service_name": name,
        "namespace": namespace,
        CONN_KEY: task.conn_id,
        "version": version,
        "previous_version": previous_version(version_history(service), version) if version else None,
        "tpu": tpu.to_dict() if tpu else None,
        "serve_url": task.service_backend.serve_endpoint(name, namespace).url,
    }


def check_rollback_owner(current: dict[str, Any], origin: AirflowOrigin) -> None:
    """A RayService is rolled back only by a task of the DAG that deployed it, in the same Airflow deployment (any
    of its tasks: rolling back is often a task of its own); the service keeps its owner.

    :raises ConflictError: another DAG deployed it, or this provider did not.
    """
    metadata = current["metadata"]
    owner = describe_owner(current) if is_managed(current) else "no task of this provider (no managed-by label)"
    notes = annotations_of(current)
    if not is_managed(current) or (notes.get(DAG_ID_KEY), notes.get(DEPLOYMENT_KEY) or "") != (origin.dag_id,
                                                                                                origin.deployment):
        raise ConflictError(
            f"RayService {metadata['namespace']}/{metadata['name']} belongs to {owner}, not to DAG "
            f"{origin.dag_id!r}, so it is not rolled back. Roll it back from a task of the DAG that deployed it")


def roll_back(task: ServiceTaskMixin, context: Context, name: str, namespace: str, current: dict[str, Any] | None,
              in_place: bool) -> dict[str, Any]:
    """Promote the version before the current one, from the RayService alone; a retry keeps an earlier try's."""
    if current is None:
        raise InvalidInputError("rollback", True, f"RayService {namespace}/{name} does not exist",
                                "Deploy a version first; rollback promotes the one before the current")
    origin = origin_of(context, task.hook.deployment)
    check_rollback_owner(current, origin)
    if rolled_back_by(current, origin):
        task.log.info("RayService %s/%s: an earlier try of this task rolled back to %r; keeping it",
                      namespace, name, service_version(current))
        push_service_links(context, task.service_backend, name, namespace, current)
        return service_reference(task, current)
    manifest = rolled_back_service(current, in_place=in_place, origin=origin)
    manifest["metadata"]["uid"] = current["metadata"]["uid"]  # roll back the service checked, never a successor
    task.log.info("RayService %s/%s: rolling back from %r to %r", namespace, name,
                  service_version(current), service_version(manifest))
    apply_logged(task, context, manifest)
    return service_reference(task, manifest)
