"""Waiting until a RayCluster is READY: the sensor, and every task that runs a Ray job on the cluster.

One reading of a status and of the trigger's event, with one set of messages: READY gives the
status, FAILED fails the task (a retry cannot help), GONE and an unreachable API fail the try (a
retry may find the cluster back), and the end of the wait fails it with a diagnosis.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_raytpu.progress import LogPace
from airflow_provider_raytpu.status import ClusterStatus, Phase, ReconcileFailureGrace
from airflow_provider_raytpu.tasks.base import ClusterTaskMixin, fail_fast
from airflow_provider_raytpu.triggers.raycluster import DEFAULT_GRACE_PERIOD, RayClusterReadyTrigger

if TYPE_CHECKING:
    pass

#: Ready, failed or gone: the wait is over.
SETTLED = (Phase.READY, Phase.FAILED, Phase.GONE)
GONE_HINT = ("If its teardown ran, clear the task together with its setup tasks (mark the create task and the ready "
             "sensor as setups of the teardown, and a Clear re-runs them)")


class ClusterReadyWait(ClusterTaskMixin):
    """The wait for a READY RayCluster, for an operator or sensor that also is a ``BaseOperator``.

    A KubeRay reconcile failure, or ready pods whose TPU hosts Ray does not list yet, is progress
    until it has lasted :attr:`ready_grace` seconds (:class:`~airflow_provider_raytpu.status.ReconcileFailureGrace`).
    """

    deferrable: bool

    @property
    def ready_timeout(self) -> float:
        """Seconds to wait for the cluster to be READY."""
        raise NotImplementedError

    @property
    def ready_grace(self) -> float:
        """Seconds a reconcile failure (or hosts Ray does not list) may last before the wait fails."""
        return DEFAULT_GRACE_PERIOD

    def ready_target(self) -> tuple[str, str]:
        """The cluster's name and namespace."""
        with fail_fast():
            return self.resolved_name(), self.resolved_namespace()

    def ready_outcome(self, status: ClusterStatus, name: str, namespace: str) -> dict[str, Any] | None:
        """The status when READY; ``None`` while it is on its way; raises when FAILED or GONE."""
        where = f"RayCluster {namespace}/{name}"
        if status.phase is Phase.READY:
            self.log.info("%s is ready: %s", where, status.message)
            return status.to_dict()
        if status.phase is Phase.FAILED:
            raise AirflowFailException(f"{where} failed: {status.message}")
        if status.phase is Phase.GONE:
            raise AirflowException(f"{where} does not exist ({status.message}). {GONE_HINT}")
        return None

    def not_ready_after(self, name: str, namespace: str, diagnosis: str) -> str:
        return f"RayCluster {namespace}/{name} not ready after {self.ready_timeout:.0f} s.\n{diagnosis}"

    def read_status(self, name: str, namespace: str) -> ClusterStatus:
        with fail_fast():
            return self.backend.cluster_status(name, namespace, confirm_with_ray=self.confirms_with_ray)

    def defer_until_ready(self, name: str, namespace: str, poll_interval: float, method_name: str) -> NoReturn:
        """Wait in the triggerer; ``method_name`` gets its event (read it with :meth:`ready_from_event`)."""
        self.defer(
            trigger=RayClusterReadyTrigger(
                cluster_name=name,
                namespace=namespace,
                raytpu_conn_id=self.conn_id,
                deadline=time.time() + self.ready_timeout,
                poll_interval=poll_interval,
                grace_period=self.ready_grace,
                confirm_with_ray=self.confirms_with_ray,
            ),
            method_name=method_name,
            # The trigger fires its own timeout with a diagnosis first; this is only a backstop.
            timeout=timedelta(seconds=self.ready_timeout + 120),
        )

    def wait_until_ready(self, poll_interval: float, method_name: str) -> dict[str, Any]:
        """The status once the cluster is READY: at once, after waiting here, or (deferrable) in the triggerer,
        which resumes the task at ``method_name``.

        :raises AirflowException: the cluster is gone, or not READY after :attr:`ready_timeout` (with a diagnosis).
        :raises AirflowFailException: the cluster failed.
        """
        name, namespace = self.ready_target()
        status = self.read_status(name, namespace)
        if (ready := self.ready_outcome(status, name, namespace)) is not None:
            return ready
        self.log.info("RayCluster %s/%s is not ready yet (%s); waiting up to %.0f s", namespace, name,
                      status.message, self.ready_timeout)
        if self.deferrable:
            self.defer_until_ready(name, namespace, poll_interval, method_name)
        deadline = time.monotonic() + self.ready_timeout
        grace = ReconcileFailureGrace(self.ready_grace)
        pace = LogPace()
        pace.due(status.message)
        while status.phase not in SETTLED and time.monotonic() < deadline:
            time.sleep(min(poll_interval, pace.seconds_left()))
            status = grace.judge(self.read_status(name, namespace), time.time())
            if pace.due(status.message):
                self.log.info("RayCluster %s/%s: %s: %s (%.0f s)", namespace, name, status.phase.value,
                              status.message, pace.elapsed)
        if (ready := self.ready_outcome(status, name, namespace)) is not None:
            return ready
        with fail_fast():
            diagnosis = self.backend.diagnose_cluster(name, namespace, confirm_with_ray=self.confirms_with_ray)
        raise AirflowException(self.not_ready_after(name, namespace, diagnosis))

    def ready_from_event(self, event: dict[str, Any], timeout_error: type[Exception] = AirflowException,
                         ) -> dict[str, Any]:
        """The status the triggerer's event (of :meth:`defer_until_ready`) ends the wait with, or the error.

        :param timeout_error: what the end of the wait raises (a sensor's own timeout is ``AirflowSensorTimeout``).
        """
        name, namespace = event["cluster_name"], event["namespace"]
        if event["status"] == "TIMEOUT":
            raise timeout_error(self.not_ready_after(name, namespace, event["diagnosis"]))
        if event["status"] == "ERROR":
            raise AirflowFailException(event["message"])
        if event["status"] == "UNREACHABLE":  # not the wait's timeout: a retry may find the API back
            raise AirflowException(event["message"])
        ready = self.ready_outcome(ClusterStatus.from_dict(event["cluster"]), name, namespace)
        if ready is None:
            raise AirflowException(f"Unexpected event for RayCluster {namespace}/{name}: {event}")
        return ready
