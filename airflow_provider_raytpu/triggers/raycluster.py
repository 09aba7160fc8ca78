"""Wait in the triggerer until a RayCluster is ready, failed or gone."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_raytpu.dashboard.outage import DEFAULT_UNREACHABLE_GRACE, Outage, is_transient, problem_of
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.progress import LogPace, with_pace
from airflow_provider_raytpu.status import ClusterStatus, ReconcileFailureGrace

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend

DEFAULT_GRACE_PERIOD = 600.0


class RayClusterReadyTrigger(BaseTrigger):
    """Watch one RayCluster and fire when it is READY, FAILED or GONE, or at the deadline.

    A KubeRay reconcile failure (``ReplicaFailure``, e.g. pods refused by a quota) is
    progress with a reason until it has lasted ``grace_period`` seconds; then it is FAILED.
    The trigger keeps its own deadline (an Airflow defer timeout would end it without a
    word): at the deadline it fires a ``timeout`` event carrying a diagnosis of the
    hosts that are not ready and, where readable, why their pods are pending. Only that
    deadline is a timeout: an API call that times out or fails is tried again (with a line
    saying so) for ``unreachable_grace_period`` seconds, then the trigger fires ``UNREACHABLE``,
    which fails the try so that Airflow can retry it.

    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param deadline: when to give up, as a Unix timestamp.
    :param poll_interval: seconds between reads when watching is not possible.
    :param grace_period: seconds a reconcile failure may last before it fails the wait.
    :param unreachable_grace_period: seconds the Kubernetes API may be unreachable (a call timed out,
        refused, or answered 429/5xx) before the trigger fires ``UNREACHABLE`` (the task may retry).
    :param confirm_with_ray: READY only once Ray lists every TPU host with its chips and slice (hosts it
        does not list are progress until ``grace_period``), and TPU pods the GKE TPU webhook did not
        mutate are FAILED; default: the connection's ``confirm_with_ray``.
    """

    def __init__(
        self,
        cluster_name: str,
        namespace: str,
        raytpu_conn_id: str,
        deadline: float,
        poll_interval: float = 10.0,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        unreachable_grace_period: float = DEFAULT_UNREACHABLE_GRACE,
        confirm_with_ray: bool | None = None,
    ) -> None:
        super().__init__()
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self.unreachable_grace_period = unreachable_grace_period
        self.confirm_with_ray = confirm_with_ray

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "cluster_name": self.cluster_name,
                "namespace": self.namespace,
                "raytpu_conn_id": self.raytpu_conn_id,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "grace_period": self.grace_period,
                "unreachable_grace_period": self.unreachable_grace_period,
                "confirm_with_ray": self.confirm_with_ray,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        where = {"cluster_name": self.cluster_name, "namespace": self.namespace}
        grace = ReconcileFailureGrace(self.grace_period)
        pace = LogPace()
        outage = Outage(self.unreachable_grace_period)
        backend: ClusterBackend | None = None
        self._last: ClusterStatus | None = None
        while True:
            try:
                if backend is None:
                    backend = await RayTpuHook(self.raytpu_conn_id).abackend()
                final = await self._wait(backend, grace, pace)
                break
            except FatalError as exc:
                yield TriggerEvent({**where, "status": "ERROR", "message": str(exc)})
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # An API call that timed out or failed is not the wait's deadline: try again, then let the task retry.
                outage.failed()
                what = f"RayCluster {self.namespace}/{self.cluster_name}: the Kubernetes API unreachable"
                if outage.over_grace or time.time() >= self.deadline:
                    yield TriggerEvent({**where, "status": "UNREACHABLE",
                                        "message": outage.given_up(what, problem_of(exc))})
                    return
                if outage.failures == 1 or pace.due():
                    log = self.log.warning if outage.failures == 1 else self.log.info
                    log("%s", outage.describe(what, problem_of(exc)))
                await asyncio.sleep(min(outage.backoff(), max(0.0, self.deadline - time.time())))
        # The watch is closed before the event goes out: a consumer that takes only the first
        # event and never resumes this generator (``dag.test()``) leaves no open watch or client
        # behind for the event loop's shutdown to trip over.
        if final is not None:
            yield TriggerEvent({**where, "status": final.phase.value, "cluster": final.to_dict()})
            return
        try:
            diagnosis = await backend.adiagnose_cluster(self.cluster_name, self.namespace,
                                                confirm_with_ray=self._confirms(backend))
        except Exception as exc:  # the deadline came first; the diagnosis is a courtesy
            diagnosis = f"(no diagnosis: {exc})"
        yield TriggerEvent({**where, "status": "TIMEOUT", "diagnosis": diagnosis})

    def _confirms(self, backend: ClusterBackend) -> bool:
        return backend.settings.confirm_with_ray if self.confirm_with_ray is None else self.confirm_with_ray

    async def _wait(self, backend: ClusterBackend, grace: ReconcileFailureGrace,
                    pace: LogPace) -> ClusterStatus | None:
        """Watch until the cluster is READY, FAILED or GONE (that status, or FAILED when a reconcile failure
        outlasts its grace), or the deadline (``None``).

        A ``TimeoutError`` is the deadline only when this wait's own timeout expired; another one
        (an API call's) is raised as the transient error it is.
        """
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.time())) as wait:
                async with contextlib.aclosing(
                    backend.watch_cluster(self.cluster_name, self.namespace, poll_interval=self.poll_interval,
                                          confirm_with_ray=self._confirms(backend))
                ) as statuses, contextlib.aclosing(with_pace(statuses, pace)) as beats:
                    async for item in beats:
                        self._last = item or self._last
                        if self._last is None:
                            pace.quiet()  # nothing read yet
                            continue
                        if pace.due(self._last.message):
                            self.log.info("RayCluster %s: %s: %s (%.0f s)", self.cluster_name,
                                          self._last.phase.value, self._last.message, pace.elapsed)
                        status = grace.judge(self._last, time.time())
                        if status.finished:
                            return status
                        # A reconcile failure ends the wait when its grace period runs out, even if
                        # nothing changes meanwhile: wake up then.
                        left = grace.seconds_left(status, time.time())
                        wake = self.deadline if left is None else min(self.deadline, time.time() + left)
                        wait.reschedule(asyncio.get_running_loop().time() + max(0.0, wake - time.time()))
        except TimeoutError:
            if not wait.expired():
                raise
        expired = grace.judge(self._last, time.time()) if self._last is not None else None
        if expired is not None and expired.finished and time.time() < self.deadline:
            self.log.info("RayCluster %s: %s", self.cluster_name, expired.message)
            return expired
        return None
