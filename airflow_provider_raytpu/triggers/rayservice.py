"""Wait in the triggerer until a RayService serves a model version, fails, or is stuck deploying."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.progress import LogPace
from airflow_provider_raytpu.status import APP_DEPLOYING, APP_UNHEALTHY, ServicePhase, ServiceStatus

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ServiceBackend

DEPLOYING_TIMEOUT = "DEPLOYING_TIMEOUT"
DEFAULT_GRACE_PERIOD = 600.0


class ApplicationClock:
    """How long each application has been in one state (DEPLOYING, UNHEALTHY) on the cluster meant to serve it.

    An application's clock starts when it is first seen in the state there and stops when
    it is anything else; time the cluster spends provisioning its slices does not count.

    :param limit: seconds an application may stay in the state; ``None``: no limit.
    :param state: the application state to time.
    """

    def __init__(self, limit: float | None, state: str = APP_DEPLOYING) -> None:
        self.limit = limit
        self.state = state
        self.since: dict[str, float] = {}

    def update(self, status: ServiceStatus, now: float) -> None:
        role = "pending" if status.pending_cluster else "active"
        timed = {
            f"{status.target_cluster}/{app.name}"
            for app in status.applications_on(role)
            if app.status == self.state
        }
        self.since = {key: self.since.get(key, now) for key in timed}

    def overdue(self, now: float) -> tuple[str, float] | None:
        """The application in the state longest, and for how long, once that is past the limit."""
        if self.limit is None or not self.since:
            return None
        key = min(self.since, key=self.since.__getitem__)
        waited = now - self.since[key]
        return (key.split("/", 1)[1], waited) if waited >= self.limit else None

    def seconds_left(self, now: float) -> float | None:
        if self.limit is None or not self.since:
            return None
        return max(0.0, min(self.since.values()) + self.limit - now)


class RayServiceRunningTrigger(BaseTrigger):
    """Watch one RayService and fire when it serves ``version``, fails, stays unhealthy, or is gone.

    An application DEPLOY_FAILED fails at once; one UNHEALTHY (Serve may recover it) fires
    ``UNHEALTHY`` only once it has been so for ``grace_period`` seconds. Fires
    ``DEPLOYING_TIMEOUT`` with a diagnosis when an application stays DEPLOYING longer than
    ``deploying_timeout``, and ``TIMEOUT`` with a diagnosis at the deadline (the trigger
    keeps its own deadline: an Airflow defer timeout would end it without a word).

    :param service_name: the RayService's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param deadline: when to give up, as a Unix timestamp.
    :param version: the version to wait for; ``None``: the one the spec asks for.
    :param deploying_timeout: seconds an application may stay DEPLOYING; ``None``: no limit.
    :param poll_interval: seconds between reads when watching is not possible.
    :param grace_period: seconds an application may stay UNHEALTHY.
    """

    def __init__(
        self,
        service_name: str,
        namespace: str,
        raytpu_conn_id: str,
        deadline: float,
        version: str | None = None,
        deploying_timeout: float | None = None,
        poll_interval: float = 10.0,
        grace_period: float = DEFAULT_GRACE_PERIOD,
    ) -> None:
        super().__init__()
        self.service_name = service_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.deadline = deadline
        self.version = version
        self.deploying_timeout = deploying_timeout
        self.poll_interval = poll_interval
        self.grace_period = grace_period

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "service_name": self.service_name,
                "namespace": self.namespace,
                "raytpu_conn_id": self.raytpu_conn_id,
                "deadline": self.deadline,
                "version": self.version,
                "deploying_timeout": self.deploying_timeout,
                "poll_interval": self.poll_interval,
                "grace_period": self.grace_period,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        where = {"service_name": self.service_name, "namespace": self.namespace, "version": self.version}
        try:
            services = (await RayTpuHook(self.raytpu_conn_id).abackend()).services
            try:
                async with asyncio.timeout(max(0.0, self.deadline - time.time())):
                    payload = await self._wait(services)
            except TimeoutError:
                diagnosis = await services.adiagnose_service(self.service_name, self.namespace, self.version)
                payload = {"status": "TIMEOUT", "diagnosis": diagnosis}
        except FatalError as exc:
            payload = {"status": "ERROR", "message": str(exc)}
        # The watch is closed before the event goes out: a consumer that takes only the first
        # event and never resumes this generator (``dag.test()``) leaves nothing open behind.
        yield TriggerEvent({**where, **payload})

    async def _wait(self, services: ServiceBackend) -> dict[str, Any]:
        """Follow the watch through a queue, so the deploying clock and refreshes tick between events."""
        queue: asyncio.Queue[ServiceStatus | BaseException] = asyncio.Queue()
        producer = asyncio.create_task(self._produce(services, queue))
        clock = ApplicationClock(self.deploying_timeout)
        unhealthy = ApplicationClock(self.grace_period, APP_UNHEALTHY)
        last: ServiceStatus | None = None
        pace = LogPace()
        try:
            while True:
                status = await self._next_status(services, queue, last, (clock, unhealthy), pace) or last
                if status is None:
                    pace.quiet()  # nothing read yet
                    continue
                last = status
                now = time.time()
                clock.update(status, now)
                unhealthy.update(status, now)
                if pace.due(status.message):
                    self.log.info("RayService %s: %s: %s (%.0f s)", self.service_name, status.phase.value,
                                  status.message, pace.elapsed)
                if (payload := await self._verdict(services, status, now, clock, unhealthy)) is not None:
                    return payload
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer

    async def _produce(self, services: ServiceBackend, queue: asyncio.Queue[ServiceStatus | BaseException]) -> None:
        try:
            async with contextlib.aclosing(
                services.watch_service(self.service_name, self.namespace, self.version, self.poll_interval)
            ) as statuses:
                async for status in statuses:
                    await queue.put(status)
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(exc)

    async def _next_status(self, services: ServiceBackend, queue: asyncio.Queue[ServiceStatus | BaseException],
                           last: ServiceStatus | None, clocks: tuple[ApplicationClock, ...],
                           pace: LogPace) -> ServiceStatus | None:
        """The watch's next status; when a clock or the log's pace comes due first, a fresh read if the last
        status asks for refreshes, else ``None``."""
        now = time.time()
        refresh = last is not None and last.refresh
        waits = [w for w in (*(c.seconds_left(now) for c in clocks), pace.seconds_left(),
                             self.poll_interval if refresh else None) if w is not None]
        try:
            item = await asyncio.wait_for(queue.get(), timeout=min(waits) if waits else None)
        except TimeoutError:
            item = None
        if isinstance(item, BaseException):
            raise item
        if item is None and refresh:
            return await services.aservice_status(self.service_name, self.namespace, self.version)
        return item

    async def _verdict(self, services: ServiceBackend, status: ServiceStatus, now: float, clock: ApplicationClock,
                       unhealthy: ApplicationClock) -> dict[str, Any] | None:
        """The event's payload once the service is done, unhealthy too long or past its deploying timeout."""
        if status.finished:
            return {"status": status.phase.value, "service": status.to_dict()}
        if overdue := unhealthy.overdue(now):
            return {"status": ServicePhase.UNHEALTHY.value, "service": status.to_dict(), "waited": overdue[1]}
        if overdue := clock.overdue(now):
            application, waited = overdue
            diagnosis = await services.adiagnose_service(self.service_name, self.namespace, self.version, waited)
            return {"status": DEPLOYING_TIMEOUT, "application": application, "waited": waited,
                    "diagnosis": diagnosis}
        return None
