"""The jobs of one Ray cluster, read once per tick for every trigger that follows one of them.

A :class:`JobBoard` asks the cluster's dashboard for its job list (``GET /api/jobs/``, Ray's
Jobs REST API) once per tick while any trigger follows a job there, and hands each follower
its job's entry: 200 job triggers on 10 clusters make 10 status requests per tick, not 200.
The tick is the shortest ``poll_interval`` of the followers. One board per cluster per event
loop (the triggerer's); it stops, and is forgotten, when its last follower leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.loop_shared import loop_shared

if TYPE_CHECKING:
    from airflow_provider_raytpu.dashboard.transport import HttpTransport


class DashboardError(Exception):
    """The Ray dashboard answered a Jobs API request with an error status."""


class JobView:
    """What one follower sees of its job: the latest entry of the cluster's job list.

    :param submission_id: the job's submission id.
    :param interval: seconds between reads the follower wants.
    :param wake: set after every read (the follower's own event).
    """

    def __init__(self, submission_id: str, interval: float, wake: asyncio.Event) -> None:
        self.submission_id = submission_id
        self.interval = interval
        self.wake = wake
        #: The job's entry (``status``, ``message``, ...); ``None``: the cluster does not list it.
        self.job: dict[str, Any] | None = None
        #: What the last read raised, if it failed (the dashboard unreachable, an error status).
        self.error: Exception | None = None
        #: Reads so far.
        self.reads = 0
        #: When the last read was sent (``time.monotonic()``): what it says is no newer than that.
        self.read_started = 0.0

    def offer(self, job: dict[str, Any] | None, error: Exception | None, started: float) -> None:
        self.job, self.error, self.read_started = job, error, started
        self.reads += 1
        self.wake.set()


class JobBoard:
    """The job list of one cluster's dashboard, shared by every trigger following a job on it.

    :param dashboard: the cluster's dashboard transport (looked up again each tick: a local
        cluster's head may move to fresh ports).
    :param where: the cluster, for messages.
    """

    def __init__(self, dashboard: Callable[[], Awaitable[HttpTransport]], where: str,
                 released: Callable[[JobBoard], Awaitable[None]] | None = None) -> None:
        self._dashboard = dashboard
        self.where = where
        self._released = released
        self.requests = 0
        self._views: set[JobView] = set()
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def follow(self, submission_id: str, interval: float, wake: asyncio.Event) -> AsyncIterator[JobView]:
        """Follow one job: its :class:`JobView` is updated (and ``wake`` set) every tick."""
        view = JobView(submission_id, interval, wake)
        self._views.add(view)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"raytpu-jobs-{self.where}")
        try:
            yield view
        finally:
            self._views.discard(view)
            if not self._views and self._task is not None:
                task, self._task = self._task, None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if not self._views and self._released is not None:
                await self._released(self)

    async def _run(self) -> None:
        while self._views:
            started = time.monotonic()
            try:
                jobs, error = await self._read(), None
            except Exception as exc:  # each follower counts failures and gives up in its own time
                jobs, error = {}, exc
            for view in list(self._views):
                view.offer(jobs.get(view.submission_id), error, started)
            await asyncio.sleep(min(view.interval for view in self._views) if self._views else 0)

    async def _read(self) -> dict[str, dict[str, Any]]:
        transport = await self._dashboard()
        answer = await transport.arequest("GET", "/api/jobs/", headers={"Accept": "application/json"})
        self.requests += 1
        if not answer.ok:
            raise DashboardError(f"GET /api/jobs/ on the dashboard of {self.where} answered {answer.status}: "
                                 f"{answer.text(500)}")
        return {job["submission_id"]: job for job in answer.json() if job.get("submission_id")}


async def job_board(key: tuple[str, str, str], dashboard: Callable[[], Awaitable[HttpTransport]]) -> JobBoard:
    """The running event loop's board for the cluster ``key`` = (connection id, namespace, cluster name)."""
    conn_id, namespace, name = key
    shared = loop_shared()

    async def release(board: JobBoard) -> None:  # its last follower left: nothing of the cluster stays
        await shared.discard(("job-board", *key), board)

    async def make() -> JobBoard:
        return JobBoard(dashboard, f"RayCluster {namespace}/{name}", release)

    return await shared.get(("job-board", *key), make)
