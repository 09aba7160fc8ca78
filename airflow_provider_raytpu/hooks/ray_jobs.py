"""The Ray Jobs REST API of a cluster's dashboard, wherever the dashboard is.

Every request goes through the transport the connection's backend gives for the
cluster's dashboard (:meth:`~airflow_provider_raytpu.backends.base.ClusterBackend.dashboard`;
on Kubernetes by default the API server's service proxy with the Kubernetes client's own
authentication), so this hook does not know which backend it talks to, and needs no Ray: sync
calls go through :class:`~airflow_provider_raytpu.dashboard.jobs.JobsApi` (what Ray's
``JobSubmissionClient`` sends, ``py_modules`` and ``working_dir`` uploads too) on that
transport; the triggers' async calls use the transport directly: a job's
status from its cluster's shared :class:`~airflow_provider_raytpu.dashboard.job_board.JobBoard`,
its log from Ray's streaming tail (:class:`~airflow_provider_raytpu.dashboard.log_tail.LogTail`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.sdk import BaseHook

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID
from airflow_provider_raytpu.dashboard.job_board import DashboardError, JobBoard, job_board
from airflow_provider_raytpu.dashboard.jobs import JobRecord, JobsApi
from airflow_provider_raytpu.dashboard.log_tail import LogTail
from airflow_provider_raytpu.dashboard.outage import DEFAULT_UNREACHABLE_GRACE, call_through_outage
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

T = TypeVar("T")

METADATA_PREFIX = "raytpu."
ACTIVE = frozenset({"PENDING", "RUNNING"})
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


@dataclass(frozen=True)
class JobIdentity:
    """Which Airflow task try a Ray job belongs to; carried as job metadata.

    :param dag_id: the DAG id.
    :param task_id: the task id.
    :param run_id: the DAG run id.
    :param map_index: the map index (-1 when not mapped).
    :param try_number: the Airflow try that submitted the job.
    :param max_tries: the try's ``max_tries``: the same for every retry, changed by a Clear.
    :param run_token: tells this DAG run from an earlier one with the same run id (deleted, created again).
    """

    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    try_number: int
    max_tries: int = -1
    run_token: str = ""

    @property
    def task_key(self) -> str:
        parts: list[object] = [self.dag_id, self.task_id, self.run_id, self.map_index]
        text = json.dumps(parts + [self.run_token] if self.run_token else parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def submission_id(self) -> str:
        """Deterministic per task try, so a resubmitted request cannot start a second job."""
        return f"raytpu-{self.task_key}-try{self.try_number}"

    def metadata(self) -> dict[str, str]:
        return {
            f"{METADATA_PREFIX}task_key": self.task_key,
            f"{METADATA_PREFIX}dag_id": self.dag_id,
            f"{METADATA_PREFIX}task_id": self.task_id,
            f"{METADATA_PREFIX}run_id": self.run_id,
            f"{METADATA_PREFIX}map_index": str(self.map_index),
            f"{METADATA_PREFIX}try_number": str(self.try_number),
            f"{METADATA_PREFIX}max_tries": str(self.max_tries),
        }


__all__ = ["ACTIVE", "TERMINAL", "DashboardError", "JobIdentity", "RayJobsHook"]


class RayJobsHook(BaseHook):
    """Submit, find, follow and stop Ray jobs on one cluster.

    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param cluster_hook: the task's connection hook, when it has one already (one connection
        lookup and one backend per task).
    :param unreachable_grace_period: seconds a synchronous call keeps trying while the dashboard (or the
        API server proxying it) is unreachable: refused, timed out, or answering 429/502/503/504.
    """

    def __init__(self, cluster_name: str, namespace: str | None = None,
                 raytpu_conn_id: str = DEFAULT_CONN_ID, cluster_hook: RayTpuHook | None = None,
                 unreachable_grace_period: float = DEFAULT_UNREACHABLE_GRACE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cluster_name = cluster_name
        self.raytpu_conn_id = raytpu_conn_id
        self.unreachable_grace_period = unreachable_grace_period
        self._namespace = namespace
        self._cluster_hook = cluster_hook

    @cached_property
    def cluster_hook(self) -> RayTpuHook:
        return self._cluster_hook or RayTpuHook(self.raytpu_conn_id)

    @property
    def backend(self) -> ClusterBackend:
        return self.cluster_hook.backend

    @property
    def namespace(self) -> str:
        return self._namespace or self.cluster_hook.settings.namespace

    @cached_property
    def dashboard(self) -> HttpTransport:
        """The cluster's dashboard, as the connection's backend reaches it."""
        return self.backend.dashboard(self.cluster_name, self.namespace)

    @property
    def dashboard_url(self) -> str:
        return self.dashboard.url

    @property
    def browser_url(self) -> str | None:
        """The dashboard as a browser can open it, or ``None`` behind the API server proxy."""
        return self.dashboard.browser_url

    @cached_property
    def client(self) -> JobsApi:
        """Ray's Jobs REST API on the cluster's dashboard."""
        return JobsApi(self.dashboard)

    def get_conn(self) -> JobsApi:
        return self.client

    def _through_outage(self, call: Callable[[], T]) -> T:
        """``call()``, tried again while the dashboard is unreachable, up to :attr:`unreachable_grace_period`
        seconds."""
        return call_through_outage(call, f"the dashboard of RayCluster {self.namespace}/{self.cluster_name}",
                                   self.unreachable_grace_period, self.log)

    # -- sync: every call rides through a dashboard or API-server outage -----------------------

    def submit(
        self,
        identity: JobIdentity,
        entrypoint: str,
        *,
        runtime_env: Mapping[str, Any] | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Submit a job under the try's deterministic submission id; a repeat (also one whose first
        answer was lost in an outage) finds the same job."""

        def submit() -> str:
            try:
                return self.client.submit_job(
                    entrypoint=entrypoint,
                    submission_id=identity.submission_id,
                    runtime_env=dict(runtime_env or {}),
                    metadata={**(metadata or {}), **identity.metadata()},
                    entrypoint_num_cpus=entrypoint_num_cpus,
                    entrypoint_resources=dict(entrypoint_resources) if entrypoint_resources else None,
                )
            except RuntimeError as exc:
                if "already exists" not in str(exc):
                    raise
                return identity.submission_id

        return self._through_outage(submit)

    def list_jobs(self) -> list[JobRecord]:
        """Every job Ray records on the cluster."""
        return self._through_outage(self.client.list_jobs)

    def find_jobs(self, identity: JobIdentity) -> list[JobRecord]:
        """This task's jobs (any try), newest try first."""
        key = identity.metadata()[f"{METADATA_PREFIX}task_key"]
        jobs = self.list_jobs()
        mine = [j for j in jobs if (j.metadata or {}).get(f"{METADATA_PREFIX}task_key") == key]
        return sorted(mine, key=lambda j: int((j.metadata or {}).get(f"{METADATA_PREFIX}try_number", 0)), reverse=True)

    def status(self, submission_id: str) -> tuple[str, str]:
        info = self.info(submission_id)
        return info.status, info.message or ""

    def info(self, submission_id: str) -> JobRecord:
        """Everything Ray records of the job: status, entrypoint, the driver's exit code, ..."""
        return self._through_outage(lambda: self.client.get_job_info(submission_id))

    def logs(self, submission_id: str) -> str:
        return self._through_outage(lambda: self.client.get_job_logs(submission_id))

    def wall_seconds(self, submission_id: str) -> float | None:
        """How long the job ran (or has run so far), from Ray's record; ``None`` before it started."""
        info = self.info(submission_id)
        if not info.start_time:
            return None
        end = info.end_time or time.time() * 1000
        return max(0.0, (end - info.start_time) / 1000)

    def stop(self, submission_id: str) -> bool:
        return self._through_outage(lambda: self.client.stop_job(submission_id))

    # -- async (triggers) -------------------------------------------------------------------

    async def _abackend(self) -> tuple[ClusterBackend, str]:
        backend = await self.cluster_hook.abackend()
        return backend, self._namespace or backend.settings.namespace

    async def adashboard(self) -> HttpTransport:
        """The cluster's dashboard, looked up anew (a local cluster whose head failed to start moves to fresh ports)."""
        backend, namespace = await self._abackend()
        return await asyncio.to_thread(backend.dashboard, self.cluster_name, namespace)

    async def _arequest(self, method: str, endpoint: str) -> Any:
        dashboard = await self.adashboard()
        answer = await dashboard.arequest(method, endpoint, headers={"Accept": "application/json"})
        if not answer.ok:
            _, namespace = await self._abackend()
            raise DashboardError(f"{method} {endpoint} on the dashboard of RayCluster {namespace}/{self.cluster_name} "
                                 f"answered {answer.status}: {answer.text(500)}")
        return answer.json()

    async def ajob_board(self) -> JobBoard:
        """The event loop's shared job list of this cluster."""
        _, namespace = await self._abackend()
        return await job_board((self.raytpu_conn_id, namespace, self.cluster_name), self.adashboard)

    def log_tail(self, submission_id: str, offset: int, wake: asyncio.Event, interval: float) -> LogTail:
        """Follow a job's log from ``offset`` characters on (an async context manager)."""
        return LogTail(self.adashboard, submission_id, offset, wake, interval)

    async def astatus(self, submission_id: str) -> tuple[str, str]:
        info = await self._arequest("GET", f"/api/jobs/{submission_id}")
        return info["status"], info.get("message") or ""

    async def alogs(self, submission_id: str) -> str:
        return str((await self._arequest("GET", f"/api/jobs/{submission_id}/logs"))["logs"])

    async def astop(self, submission_id: str) -> bool:
        return bool((await self._arequest("POST", f"/api/jobs/{submission_id}/stop")).get("stopped"))
