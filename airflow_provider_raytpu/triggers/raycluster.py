"""Wait in the triggerer until a RayCluster is ready, failed or gone."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.progress import Heartbeat, with_heartbeat
from airflow_provider_raytpu.status import ClusterStatus, ReconcileFailureGrace

DEFAULT_GRACE_PERIOD = 600.0


class RayClusterReadyTrigger(BaseTrigger):
    """Watch one RayCluster and fire when it is READY, FAILED or GONE, or at the deadline.

    A KubeRay reconcile failure (``ReplicaFailure``, e.g. pods refused by a quota) is
    progress with a reason until it has lasted ``grace_period`` seconds; then it is FAILED.
    The trigger keeps its own deadline (an Airflow defer timeout would end it without a
    word): at the deadline it fires a ``timeout`` event carrying a diagnosis of the
    hosts that are not ready and, where readable, why their pods are pending.

    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param deadline: when to give up, as a Unix timestamp.
    :param poll_interval: seconds between reads when watching is not possible.
    :param grace_period: seconds a reconcile failure may last before it fails the wait.
    """

    def __init__(
        self,
        cluster_name: str,
        namespace: str,
        raytpu_conn_id: str,
        deadline: float,
        poll_interval: float = 10.0,
        grace_period: float = DEFAULT_GRACE_PERIOD,
    ) -> None:
        super().__init__()
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.grace_period = grace_period

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
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        where = {"cluster_name": self.cluster_name, "namespace": self.namespace}
        grace = ReconcileFailureGrace(self.grace_period)
        last: ClusterStatus | None = None
        try:
            backend = await RayTpuHook(self.raytpu_conn_id).abackend()
            heartbeat = Heartbeat()
            final = None
            async with asyncio.timeout(max(0.0, self.deadline - time.time())) as wait:
                async with contextlib.aclosing(
                    backend.watch_cluster(self.cluster_name, self.namespace, poll_interval=self.poll_interval)
                ) as statuses, contextlib.aclosing(with_heartbeat(statuses, heartbeat)) as beats:
                    async for item in beats:
                        last = item or last
                        if last is None:
                            heartbeat.quiet()  # nothing read yet
                            continue
                        if heartbeat.due(last.message):
                            self.log.info("RayCluster %s: %s: %s (%.0f s)", self.cluster_name, last.phase.value,
                                          last.message, heartbeat.elapsed)
                        status = grace.judge(last, time.time())
                        if status.finished:
                            final = status
                            break
                        # A reconcile failure ends the wait when its grace period runs out, even if
                        # nothing changes meanwhile: wake up then.
                        left = grace.seconds_left(status, time.time())
                        wake = self.deadline if left is None else min(self.deadline, time.time() + left)
                        wait.reschedule(asyncio.get_running_loop().time() + max(0.0, wake - time.time()))
            # The watch is closed before the event goes out: a consumer that takes only the
            # first event and never resumes this generator (``dag.test()``) leaves no open
            # watch or client behind for the event loop's shutdown to trip over.
            if final is not None:
                yield TriggerEvent({**where, "status": final.phase.value, "cluster": final.to_dict()})
        except TimeoutError:
            expired = grace.judge(last, time.time()) if last is not None else None
            if expired is not None and expired.finished and time.time() < self.deadline:
                self.log.info("RayCluster %s: %s", self.cluster_name, expired.message)
                yield TriggerEvent({**where, "status": expired.phase.value, "cluster": expired.to_dict()})
                return
            diagnosis = await backend.adiagnose(self.cluster_name, self.namespace)
            yield TriggerEvent({**where, "status": "TIMEOUT", "diagnosis": diagnosis})
        except FatalError as exc:
            yield TriggerEvent({**where, "status": "ERROR", "message": str(exc)})
