"""A small HTTP server standing in for the Ray dashboards' Jobs API of several clusters, reached
through the fake API server's service proxy (``url_for(cluster)`` is what to register).

It answers what Ray 2.x's dashboard answers (``ray/dashboard/modules/job/job_head.py``) for the
requests the provider's triggers make: ``GET /api/jobs/`` (every job of the cluster),
``GET /api/jobs/{id}``, ``GET /api/jobs/{id}/logs`` (the whole log), ``POST /api/jobs/{id}/stop``
and the WebSocket ``/api/jobs/{id}/logs/tail``: the log from its start in messages of at most
10 lines, then each new piece as it is appended, closed once the job has ended and its log is
drained (Ray's ``file_tail_iterator``). A test drives jobs with :meth:`JobsStub.add`,
``append``, ``finish`` and ``forget``, cuts every open tail with :meth:`JobsStub.cut_tails`; ``requests``
counts requests per (cluster, route). A cluster given a token in ``tokens`` answers as Ray's token
authentication does (``ray/_private/authentication/http_token_authentication.py``): 401 without a
token, 403 with another one, in ``Authorization`` or ``X-Ray-Authorization``.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.threaded_app import ThreadedApp

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass
class StubJob:
    submission_id: str
    status: str = "RUNNING"
    message: str = ""
    log: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def details(self) -> dict[str, Any]:
        return {"type": "SUBMISSION", "job_id": None, "submission_id": self.submission_id, "status": self.status,
                "message": self.message, "entrypoint": "python job.py", "metadata": {}}


class JobsStub(ThreadedApp):
    """An aiohttp server on 127.0.0.1 in its own thread with the Jobs API of any number of clusters."""

    def __init__(self, tail_sleep: float = 0.05) -> None:
        super().__init__()
        self.tail_sleep = tail_sleep
        #: Seconds a tail stays open after its job ended and its log was sent (a dashboard slow to close it).
        self.tail_lag = 0.0
        #: Seconds a job list takes to answer (a loaded dashboard); it lists the jobs as they were when asked.
        self.list_lag = 0.0
        self.jobs: dict[str, dict[str, StubJob]] = collections.defaultdict(dict)
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.tokens: dict[str, str] = {}
        self.tail_bytes = 0
        self._tails: set[web.WebSocketResponse] = set()

    # -- what a test does ------------------------------------------------------------------------

    def url_for(self, cluster: str) -> str:
        return f"http://127.0.0.1:{self.port}/{cluster}"

    def _call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def add(self, cluster: str, submission_id: str, log: str = "", status: str = "RUNNING") -> None:
        self._call(self._add, cluster, submission_id, log, status)

    def _add(self, cluster: str, submission_id: str, log: str, status: str) -> None:
        self.jobs[cluster][submission_id] = StubJob(submission_id, status, log=log)

    def append(self, cluster: str, submission_id: str, text: str) -> None:
        self._call(self._change, cluster, submission_id, text, None, "")

    def finish(self, cluster: str, submission_id: str, status: str = "SUCCEEDED", message: str = "",
               text: str = "") -> None:
        self._call(self._change, cluster, submission_id, text, status, message)

    def forget(self, cluster: str, submission_id: str) -> None:
        """Drop the job from the cluster's list, as a restarted head does; an open tail stays open."""
        self._call(self.jobs[cluster].pop, submission_id)

    def _change(self, cluster: str, submission_id: str, text: str, status: str | None, message: str) -> None:
        job = self.jobs[cluster][submission_id]
        job.log += text
        if status is not None:
            job.status, job.message = status, message
        job.changed.set()

    def cut_tails(self) -> int:
        """Close every open log tail mid-stream (a restarted head, a dropped proxy); returns how many."""

        async def cut() -> int:
            tails = list(self._tails)
            for ws in tails:
                await ws.close()
            return len(tails)

        return asyncio.run_coroutine_threadsafe(cut(), self._loop).result(10)

    @property
    def open_tails(self) -> int:
        return len(self._tails)

    # -- the Jobs API ------------------------------------------------------------------------------

    def _job(self, request: web.Request) -> StubJob:
        job = self.jobs[request.match_info["cluster"]].get(request.match_info["id"])
        if job is None:
            raise web.HTTPNotFound(text=f"Job {request.match_info['id']} does not exist")
        return job

    def _count(self, request: web.Request, route: str) -> None:
        cluster = request.match_info["cluster"]
        if token := self.tokens.get(cluster):
            given = request.headers.get("Authorization") or request.headers.get("X-Ray-Authorization")
            if not given:
                raise web.HTTPUnauthorized(text="Unauthorized: Missing authentication token")
            if given != f"Bearer {token}":
                raise web.HTTPForbidden(text="Forbidden: Invalid authentication token")
        self.requests[(cluster, route)] += 1

    async def _list(self, request: web.Request) -> web.Response:
        self._count(request, "list")
        listed = [job.details() for job in self.jobs[request.match_info["cluster"]].values()]
        if self.list_lag:
            await asyncio.sleep(self.list_lag)
        return web.json_response(listed)

    async def _get(self, request: web.Request) -> web.Response:
        self._count(request, "get")
        return web.json_response(self._job(request).details())

    async def _logs(self, request: web.Request) -> web.Response:
        self._count(request, "logs")
        return web.json_response({"logs": self._job(request).log})

    async def _stop(self, request: web.Request) -> web.Response:
        self._count(request, "stop")
        job = self._job(request)
        stopped = job.status not in TERMINAL
        if stopped:
            self._change(request.match_info["cluster"], job.submission_id, "", "STOPPED", "stopped by the user")
        return web.json_response({"stopped": stopped})

    async def _tail(self, request: web.Request) -> web.StreamResponse:
        self._count(request, "tail")
        job = self._job(request)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self._tails.add(ws)
        sent, lagged = 0, False
        try:
            while not ws.closed:
                if sent < len(job.log):
                    end = sent
                    for _ in range(10):
                        newline = job.log.find("\n", end)
                        end = len(job.log) if newline < 0 else newline + 1
                        if end >= len(job.log):
                            break
                    chunk = job.log[sent:end]
                    sent = end
                    self.tail_bytes += len(chunk.encode())
                    await ws.send_str(chunk)
                    continue
                if job.status in TERMINAL:
                    if lagged or not self.tail_lag:
                        break
                    lagged = True
                    await asyncio.sleep(self.tail_lag)
                    continue
                job.changed.clear()
                try:
                    await asyncio.wait_for(job.changed.wait(), self.tail_sleep)
                except TimeoutError:
                    pass
        except ConnectionError:
            pass
        finally:
            self._tails.discard(ws)
        await ws.close()
        return ws

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{cluster}/api/jobs/", self._list)
        app.router.add_get("/{cluster}/api/jobs/{id}", self._get)
        app.router.add_get("/{cluster}/api/jobs/{id}/logs", self._logs)
        app.router.add_get("/{cluster}/api/jobs/{id}/logs/tail", self._tail)
        app.router.add_post("/{cluster}/api/jobs/{id}/stop", self._stop)
