"""The ``raytpu`` connection: which backend holds the clusters, and how to reach it."""

from __future__ import annotations

import asyncio
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID, HOW_TO_CONNECT, ConnectionSettings
from airflow_provider_raytpu.errors import FatalError
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
        return ConnectionSettings.from_extra(self.raytpu_conn_id, connection.extra_dejson)

    async def asettings(self) -> ConnectionSettings:
        """:attr:`settings`, read without blocking the event loop (for triggers)."""
        try:
            connection = await self.aget_connection(self.raytpu_conn_id)
        except AirflowNotFoundException as exc:
            raise self._missing() from exc
        return ConnectionSettings.from_extra(self.raytpu_conn_id, connection.extra_dejson)

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
        """Reach the backend and list its RayClusters; the UI's Test button calls this."""
        try:
            return True, self.backend.check()
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
