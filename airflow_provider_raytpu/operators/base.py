"""What the provider's operators and sensors share: the connection and fail-fast errors."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException
from airflow_provider_raytpu.backends.settings import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, tpu_slice_of
from airflow_provider_raytpu.tpu import TpuSlice

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow_provider_raytpu.backends.base import ClusterBackend, ServiceBackend


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Fail the task without retries on errors only the user can fix (bad input, RBAC, conflicts)."""
    try:
        yield
    except FatalError as exc:
        raise AirflowFailException(str(exc)) from exc


def wait_until_gone(kind: str, name: str, namespace: str, get: Callable[[str, str], Any],
                    timeout: float, poll_interval: float) -> None:
    """Poll ``get`` until the object is gone, or fail naming what to check."""
    deadline = time.monotonic() + timeout
    while get(name, namespace) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{kind} {namespace}/{name} still exists {timeout:.0f} s after delete; "
                f"check for stuck finalizers with kubectl get {kind.lower()} {name} -n {namespace} -o yaml"
            )
        time.sleep(poll_interval)


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

    def cluster_tpu(self, name: str, namespace: str, given: TpuSlice | None = None) -> TpuSlice:
        """The slice shape recorded on the cluster; an explicitly given shape must agree with it."""
        recorded = tpu_slice_of(self.backend.get_cluster(name, namespace) or {})
        if recorded is None:
            if given is None:
                raise FatalError(
                    f"RayCluster {namespace}/{name} does not exist or records no slice shape; create it with "
                    "CreateRayClusterOperator, or pass accelerator and topology"
                )
            return given
        if given is not None and (given.accelerator, given.topology, given.num_slices, given.host_chips) != (
            recorded.accelerator, recorded.topology, recorded.num_slices, recorded.host_chips
        ):
            raise InvalidInputError(
                "accelerator/topology/num_slices",
                given.describe(),
                f"disagrees with RayCluster {namespace}/{name}, which is {recorded.describe()}",
                "Leave the slice fields unset to use the cluster's shape, or target a cluster of this shape",
            )
        return recorded

    def cluster_reference(self, name: str, namespace: str, tpu: dict[str, Any] | None) -> dict[str, Any]:
        """The cluster reference every later task takes (no secrets in it)."""
        return {
            "cluster_name": name,
            "namespace": namespace,
            "conn_id": self.raytpu_conn_id,
            "tpu": tpu,
            "dashboard_url": self.backend.dashboard(name, namespace).url,
        }


class ServiceTaskMixin(ClusterTaskMixin):
    """An operator or sensor that works on a RayService.

    Subclasses declare ``service_name``, ``namespace`` and ``raytpu_conn_id`` as template
    fields, so ``"{{ ti.xcom_pull('deploy')['service_name'] }}"`` works.
    """

    service_name: str | None

    @property
    def service_backend(self) -> ServiceBackend:
        return self.hook.backend.services
