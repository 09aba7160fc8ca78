"""What the provider's operators and sensors share: the connection and fail-fast errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException
from airflow_provider_raytpu.backends.settings import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow_provider_raytpu.backends.base import ClusterBackend


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Fail the task without retries on errors only the user can fix (bad input, RBAC, conflicts)."""
    try:
        yield
    except FatalError as exc:
        raise AirflowFailException(str(exc)) from exc


def origin_of(context: Context) -> AirflowOrigin:
    ti = context["ti"]
    return AirflowOrigin(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id)


class ClusterTaskMixin:
    """An operator or sensor that works on an existing RayCluster.

    Subclasses declare ``cluster_name``, ``namespace`` and ``raytpu_conn_id`` as
    template fields, so ``"{{ ti.xcom_pull('create_cluster')['cluster_name'] }}"`` works.
    """

    cluster_name: str
    namespace: str | None
    raytpu_conn_id: str = DEFAULT_CONN_ID

    @cached_property
    def hook(self) -> RayTpuHook:
        return RayTpuHook(self.raytpu_conn_id)

    @property
    def backend(self) -> ClusterBackend:
        return self.hook.backend

    def resolved_namespace(self) -> str:
        return self.namespace or self.hook.settings.namespace

    def cluster_reference(self, name: str, namespace: str, tpu: dict[str, Any] | None) -> dict[str, Any]:
        """The cluster reference every later task takes (no secrets in it)."""
        return {
            "cluster_name": name,
            "namespace": namespace,
            "conn_id": self.raytpu_conn_id,
            "tpu": tpu,
            "dashboard_url": self.backend.dashboard_url(name, namespace),
        }
