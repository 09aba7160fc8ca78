"""The ``raytpu`` connection: which backend holds the clusters, and how to reach it."""

from __future__ import annotations

import asyncio
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID, HOW_TO_CONNECT, ConnectionSettings
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.renamed_fields import current_extras
from airflow_provider_raytpu.loop_shared import loop_shared

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend


#: How long the triggers of one event loop use a connection they read before reading it again.
SETTINGS_MAX_AGE_SECONDS = 300.0
_LENT = "lent-backend"


def backend_for(settings: ConnectionSettings) -> ClusterBackend:
    """The backend a connection names; its module is imported only now, so DAG parsing stays cheap."""
    if settings.backend == "local":
        from airflow_provider_raytpu.backends.local import LocalBackend

        return LocalBackend(settings)
    from airflow_provider_raytpu.backends.kuberay import KubeRayBackend

    return KubeRayBackend(settings)


def default_deployment() -> str:
    """This Airflow deployment's name when its connection names none: ``airflow-`` and a hash of the URL of the
    Execution API its workers and triggerers report to (``[core] execution_api_server_url``, by default
    ``[api] base_url`` + ``/execution/``). Every component of one deployment is configured with that URL; two
    deployments have two API servers, so two URLs. Two deployments that both leave it at its default
    (``http://localhost:8080``) derive the same name: name them in the connection (``extra.deployment``).
    """
    import hashlib

    from airflow.sdk.configuration import conf

    url = conf.get("core", "execution_api_server_url", fallback=None)
    if not url:
        url = f"{(conf.get('api', 'base_url', fallback=None) or 'http://localhost:8080').rstrip('/')}/execution/"
    return "airflow-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:10]


def dag_ids_here() -> set[str] | None:
    """The DAG ids this deployment has (from its metadata database: the API server's Test button can read it), or
    ``None`` where the database cannot be read."""
    try:
        from airflow.models.dag import DagModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            return set(session.scalars(select(DagModel.dag_id)))
    except Exception:
        return None


class ConnectionNotFoundError(FatalError):
    """The ``raytpu`` connection does not exist."""


class RayTpuHook(BaseHook):
    """Reads a ``raytpu`` connection and hands out the backend it names.

    The connection's extras choose the backend: ``local`` (Ray on this machine with
    emulated TPU slices), ``kubernetes`` (KubeRay through a cncf-kubernetes
    connection) or ``gke`` (KubeRay on a GKE cluster through a Google Cloud connection).

    :param raytpu_conn_id: the connection id.
    """

    conn_name_attr = "raytpu_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "raytpu"
    hook_name = "Ray on TPU"

    def __init__(self, raytpu_conn_id: str = DEFAULT_CONN_ID, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raytpu_conn_id = raytpu_conn_id

    def _missing(self) -> ConnectionNotFoundError:
        return ConnectionNotFoundError(f"No Airflow connection {self.raytpu_conn_id!r}. {HOW_TO_CONNECT}.")

    @cached_property
    def settings(self) -> ConnectionSettings:
        try:
            connection = self.get_connection(self.raytpu_conn_id)
        except AirflowNotFoundException as exc:
            raise self._missing() from exc
        return ConnectionSettings.from_extra(self.raytpu_conn_id,
                                             current_extras(self.raytpu_conn_id, connection.extra_dejson))

    @property
    def deployment(self) -> str:
        """The Airflow deployment this task runs in: the connection's ``deployment``, else
        :func:`default_deployment`."""
        return self.settings.deployment or default_deployment()

    async def asettings(self) -> ConnectionSettings:
        """:attr:`settings`, read without blocking the event loop (for triggers)."""
        try:
            connection = await self.aget_connection(self.raytpu_conn_id)
        except AirflowNotFoundException as exc:
            raise self._missing() from exc
        return ConnectionSettings.from_extra(self.raytpu_conn_id,
                                             current_extras(self.raytpu_conn_id, connection.extra_dejson))

    def get_conn(self) -> ClusterBackend:
        return self.backend

    @cached_property
    def backend(self) -> ClusterBackend:
        return backend_for(self.settings)

    async def abackend(self) -> ClusterBackend:
        """The backend for the triggers of the running event loop, shared by all of them.

        The connection is read once (again after :data:`SETTINGS_MAX_AGE_SECONDS`; the backend it
        replaces is closed), and the backend's modules are imported in a worker thread: the
        triggerer's loop never waits for an import.
        """

        shared = loop_shared()
        if (lent := shared.peek((_LENT, self.raytpu_conn_id))) is not None:
            return lent  # type: ignore[no-any-return]

        async def make() -> ClusterBackend:
            return await asyncio.to_thread(backend_for, await self.asettings())

        async def close(backend: ClusterBackend) -> None:
            await asyncio.to_thread(backend.close)

        return await shared.get(("backend", self.raytpu_conn_id), make, close, max_age=SETTINGS_MAX_AGE_SECONDS)

    async def lend_backend(self, backend: ClusterBackend) -> None:
        """Let the triggers run on this event loop use ``backend`` for the connection, for the loop's life (a task
        that follows its job in a loop of its own: one connection lookup and one backend per task; the task
        closes it)."""

        async def lent() -> ClusterBackend:
            return backend

        await loop_shared().get((_LENT, self.raytpu_conn_id), lent)

    def test_connection(self) -> tuple[bool, str]:
        """Reach the backend and list its RayClusters; the UI's Test button calls this. Warns when the namespace
        holds objects another Airflow deployment made for DAG ids this deployment has too."""
        try:
            lines = [self.backend.check(), f"This Airflow deployment records itself as {self.deployment!r}"]
            if warning := self.other_deployments_line():
                lines.append(warning)
            return True, "\n".join(lines)
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"

    def other_deployments_line(self) -> str | None:
        """A warning naming the RayClusters and RayServices in the connection's namespace that another deployment
        made for DAG ids this deployment has too (all of another deployment's, when this one's DAG ids cannot be
        read), or ``None``."""
        from airflow_provider_raytpu.manifests.raycluster import (
            DAG_ID_KEY,
            DEPLOYMENT_KEY,
            MANAGED_BY,
            MANAGED_BY_LABEL,
        )

        namespace, selector = self.settings.namespace, f"{MANAGED_BY_LABEL}={MANAGED_BY}"
        objects = [*self.backend.list_clusters(namespace, selector),
                   *self.backend.services.list_services(namespace, selector)]
        ours = dag_ids_here()
        theirs: dict[str, set[str]] = {}
        for obj in objects:
            notes = obj["metadata"].get("annotations") or {}
            made_by, dag_id = notes.get(DEPLOYMENT_KEY), notes.get(DAG_ID_KEY)
            if made_by and made_by != self.deployment and dag_id and (ours is None or dag_id in ours):
                theirs.setdefault(made_by, set()).add(dag_id)
        if not theirs:
            return None
        found = "; ".join(f"{made_by}: {', '.join(sorted(dags))}" for made_by, dags in sorted(theirs.items()))
        return (f"Warning: namespace {namespace!r} holds objects another Airflow deployment made for DAG ids "
                f"{'this deployment has too' if ours is not None else 'of its own'} ({found}). Each deployment "
                "keeps to its own objects, but they share the namespace's quota; if this deployment is meant to "
                "own them, its connection's extra.deployment must be theirs")
