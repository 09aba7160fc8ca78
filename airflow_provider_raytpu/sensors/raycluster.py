"""Wait until every host of every slice of a RayCluster is ready."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout

from airflow_provider_raytpu.status import ReconcileFailureGrace
from airflow_provider_raytpu.tasks.base import (
    DEFAULT_POKE_INTERVAL,
    default_deferrable,
    fail_fast,
    take_renamed,
)
from airflow_provider_raytpu.tasks.cluster_ready import ClusterReadyWait
from airflow_provider_raytpu.tasks.links import RayDashboardLink, push_dashboard_link
from airflow_provider_raytpu.triggers.raycluster import DEFAULT_GRACE_PERIOD
from airflow_provider_raytpu.values import duration_seconds

if TYPE_CHECKING:
    from airflow.sdk import Context


class RayClusterReadySensor(ClusterReadyWait, BaseSensorOperator):
    """Succeed when the RayCluster's head and every TPU host of every slice are ready.

    Deferrable when ``[operators] default_deferrable`` says so, or with ``deferrable=True``:
    the triggerer watches the RayCluster (no polling) and the worker slot is free meanwhile.
    KubeRay's ``state: ready`` is not trusted (it is never reset); readiness is the head's
    condition plus ready hosts = slices x hosts per slice. A KubeRay reconcile failure
    (``ReplicaFailure``, e.g. pods refused by a quota or a webhook timeout) is progress shown
    with its reason until it has lasted ``grace_period`` seconds; a failure of the local
    backend's Ray processes fails at once; a deleted cluster fails (retryable). At
    ``timeout`` it fails with a diagnosis: which hosts are not ready and, where readable,
    the scheduler's reason for each pending pod. Returns the cluster's status.

    With ``confirm_with_ray`` (the connection's ``confirm_with_ray``, on by default), ready pods
    are not enough: Ray must list every TPU host with its chips, its slice's name and one
    ``TPU-<pod type>-head`` per slice (what JaxTrainer reserves a slice by). Until it does, the
    progress line says what Ray lacks, and after ``grace_period`` the task fails naming the
    hosts. On Kubernetes, TPU pods that GKE's TPU webhook did not mutate (no ``TPU_WORKER_ID``;
    no ``TPU_WORKER_HOSTNAMES`` in a multi-host slice) fail it at once, with how to fix it.

    :param cluster: the cluster reference (``create.output``), instead of ``cluster_name``.
    :param cluster_name: the RayCluster's name.
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param deferrable: wait in the triggerer instead of a worker slot; default:
        ``[operators] default_deferrable``.
    :param poke_interval: how long between checks when not deferred, or when watching fails (a
        ``timedelta`` or seconds, as every duration here).
    :param poll_interval: deprecated: the old name of ``poke_interval``.
    :param timeout: how long to wait before failing with a diagnosis.
    :param grace_period: how long a KubeRay reconcile failure, or ready pods whose TPU hosts Ray does not
        list, may last before the task fails.
    :param confirm_with_ray: whether Ray must confirm the TPU hosts (above); default: the connection's
        ``confirm_with_ray``. Off for a cluster whose image serves no Ray dashboard State API.
    """

    template_fields: Sequence[str] = ("cluster", "cluster_name", "namespace", "raytpu_conn_id")
    operator_extra_links = (RayDashboardLink(),)
    ui_color = "#e6f4ea"

    def __init__(
        self,
        *,
        cluster: Any = None,
        cluster_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str | None = None,
        deferrable: bool | None = None,
        poke_interval: timedelta | float | None = None,
        timeout: timedelta | float = 3600.0,
        grace_period: timedelta | float = DEFAULT_GRACE_PERIOD,
        confirm_with_ray: bool | None = None,
        **kwargs: Any,
    ) -> None:
        poke_interval = take_renamed(kwargs, "poll_interval", "poke_interval", poke_interval)
        super().__init__(poke_interval=DEFAULT_POKE_INTERVAL if poke_interval is None else poke_interval,
                         timeout=timeout, **kwargs)
        self.cluster = cluster
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.grace_period = duration_seconds(grace_period, "grace_period", example="120", allow_zero=True)
        self.confirm_with_ray = confirm_with_ray

    @property
    def ready_timeout(self) -> float:
        return float(self.timeout)

    @property
    def ready_grace(self) -> float:
        return self.grace_period

    def poke(self, context: Context) -> PokeReturnValue:
        name, namespace = self.ready_target()
        status = self._grace.judge(self.read_status(name, namespace), time.time())
        done = self.ready_outcome(status, name, namespace)
        if done is None:
            self.log.info("RayCluster %s/%s: %s", namespace, name, status.message)
        return PokeReturnValue(is_done=done is not None, xcom_value=done)

    @cached_property
    def _grace(self) -> ReconcileFailureGrace:
        return ReconcileFailureGrace(self.grace_period)

    def execute(self, context: Context) -> dict[str, Any] | None:
        name, namespace = self.ready_target()
        with fail_fast():
            push_dashboard_link(context, self.backend, name, namespace)
        if not self.deferrable:
            try:
                done: dict[str, Any] | None = super().execute(context)
                return done
            except AirflowSensorTimeout as exc:
                with fail_fast():
                    diagnosis = self.backend.diagnose_cluster(name, namespace, confirm_with_ray=self.confirms_with_ray)
                raise AirflowSensorTimeout(self.not_ready_after(name, namespace, diagnosis)) from exc
        first = self.poke(context)
        if first.is_done:
            return first.xcom_value
        self.log.info("RayCluster %s/%s is not ready yet; waiting up to %.0f s", namespace, name, self.ready_timeout)
        self.defer_until_ready(name, namespace, self.poke_interval, "execute_complete")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        return self.ready_from_event(event, AirflowSensorTimeout)
