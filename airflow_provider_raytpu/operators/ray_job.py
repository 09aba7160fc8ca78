"""Run a Ray job on an existing cluster; retries reattach instead of starting a second job."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowException
from airflow_provider_raytpu.backends.settings import DEFAULT_CONN_ID
from airflow_provider_raytpu.hooks.ray_jobs import ACTIVE, TERMINAL, JobIdentity, RayJobsHook
from airflow_provider_raytpu.manifests.names import resource_name
from airflow_provider_raytpu.operators.base import ClusterTaskMixin, fail_fast
from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger
from airflow_provider_raytpu.workloads.result import last_result

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

LOG_TAIL_LINES = 50
PACKAGE_DIR = Path(__file__).resolve().parents[1]


class RayJobLink(BaseOperatorLink):
    """Opens the job in the Ray dashboard, when a browser can reach the dashboard."""

    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(ti_key=ti_key, key=self.xcom_key) or ""


def identity_of(context: Context) -> JobIdentity:
    ti = context["ti"]
    map_index = ti.map_index if ti.map_index is not None else -1
    return JobIdentity(ti.dag_id, ti.task_id, ti.run_id, map_index, ti.try_number)


def is_fresh_start(context: Context, retries: int) -> bool:
    """Whether this try starts a new cycle: the first try, or the first after a user's Clear.

    Clearing a task sets ``max_tries = try_number + retries``; retries leave it alone.
    """
    ti = context["ti"]
    return ti.try_number - 1 <= ti.max_tries - retries


class SubmitRayJobOperator(ClusterTaskMixin, BaseOperator):
    """Run a command as a Ray job on a RayCluster and wait for it, streaming its log.

    Every submission carries its task try as metadata and a deterministic submission
    id. On an Airflow retry the operator finds this task's jobs, newest try first: a
    pending or running job is reattached to (never a second job), a succeeded one
    returns its result without rerunning, a failed or stopped one is submitted again
    (and resumes from its checkpoints, when it keeps any). A user's Clear starts over.

    The job reports its result by printing ``RAYTPU_RESULT <json>``
    (``airflow_provider_raytpu.workloads.result.report_result``); the last such line
    is the task's return value. A failed job fails the task with its last 50 log lines.

    :param cluster_name: the RayCluster's name.
    :param entrypoint: the command, as a string or a list of arguments (joined with ``shlex.join``).
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param runtime_env: Ray runtime_env (working_dir, py_modules, env_vars, pip).
    :param ship_provider: add this provider's package to ``py_modules``, so entrypoints can
        run ``python -m airflow_provider_raytpu.workloads...`` on a stock Ray image.
    :param entrypoint_num_cpus: CPUs reserved for the driver.
    :param entrypoint_resources: custom resources reserved for the driver.
    :param metadata: extra job metadata.
    :param deferrable: wait in the triggerer instead of a worker slot.
    :param poll_interval: seconds between status polls.
    """

    template_fields: Sequence[str] = (
        "cluster_name",
        "namespace",
        "raytpu_conn_id",
        "entrypoint",
        "runtime_env",
        "entrypoint_resources",
        "metadata",
    )
    template_fields_renderers = {"runtime_env": "json", "metadata": "json"}
    operator_extra_links = (RayJobLink(),)
    ui_color = "#fef7e0"

    def __init__(
        self,
        *,
        cluster_name: str,
        entrypoint: str | Sequence[str],
        namespace: str | None = None,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        runtime_env: Mapping[str, Any] | None = None,
        ship_provider: bool = True,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
        deferrable: bool = True,
        poll_interval: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_name = cluster_name
        self.entrypoint = entrypoint
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.runtime_env = runtime_env
        self.ship_provider = ship_provider
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_resources = entrypoint_resources
        self.metadata = metadata
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.submission_id: str | None = None

    @cached_property
    def jobs(self) -> RayJobsHook:
        return RayJobsHook(resource_name(self.cluster_name, "cluster_name"), self.namespace, self.raytpu_conn_id)

    def entrypoint_command(self) -> str:
        if isinstance(self.entrypoint, str):
            return self.entrypoint
        return shlex.join(str(arg) for arg in self.entrypoint)

    def job_runtime_env(self) -> dict[str, Any]:
        env = dict(self.runtime_env or {})
        if self.ship_provider:
            modules = list(env.get("py_modules") or [])
            if str(PACKAGE_DIR) not in modules:
                env["py_modules"] = [*modules, str(PACKAGE_DIR)]
        return env

    def execute(self, context: Context) -> Any:
        with fail_fast():
            identity = identity_of(context)
            jobs = self.jobs
            previous = jobs.find_jobs(identity)
        submission_id = self._reattach_or_resubmit(context, identity, previous)
        if submission_id is None:
            return self._result(previous[0].submission_id)
        self.submission_id = submission_id
        self._persist_link(context, submission_id)
        if self.deferrable:
            self.defer(
                trigger=RayJobTrigger(
                    submission_id=submission_id,
                    cluster_name=jobs.cluster_name,
                    namespace=jobs.namespace,
                    raytpu_conn_id=self.raytpu_conn_id,
                    poll_interval=self.poll_interval,
                ),
                method_name="execute_complete",
            )
        return self._wait(submission_id)

    def _reattach_or_resubmit(self, context: Context, identity: JobIdentity, previous: list[Any]) -> str | None:
        """The job to follow: reattached, or newly submitted; ``None`` when the newest already succeeded."""
        if is_fresh_start(context, self.retries or 0):
            for job in previous:
                if str(job.status) in ACTIVE:
                    self.log.warning("Stopping Ray job %s left running by an earlier run of this task", job.submission_id)
                    self.jobs.stop(job.submission_id)
        elif previous:
            newest = previous[0]
            status = str(newest.status)
            if status in ACTIVE:
                self.log.info("Reattaching to Ray job %s (%s) from try %s", newest.submission_id, status,
                              newest.metadata.get("raytpu.try_number"))
                return newest.submission_id
            if status == "SUCCEEDED":
                self.log.info("Ray job %s already succeeded; returning its result", newest.submission_id)
                return None
            self.log.info("Ray job %s ended %s; submitting try %s", newest.submission_id, status, identity.try_number)
        submission_id = self.jobs.submit(
            identity,
            self.entrypoint_command(),
            runtime_env=self.job_runtime_env(),
            entrypoint_num_cpus=self.entrypoint_num_cpus,
            entrypoint_resources=self.entrypoint_resources,
            metadata=self.metadata,
        )
        self.log.info("Submitted Ray job %s: %s", submission_id, self.entrypoint_command())
        return submission_id

    def _persist_link(self, context: Context, submission_id: str) -> None:
        url = self.jobs.browser_url
        context["ti"].xcom_push(key=RayJobLink().xcom_key, value=f"{url}/#/jobs/{submission_id}" if url else "")

    def _wait(self, submission_id: str) -> Any:
        logged = 0
        while True:
            status, message = self.jobs.status(submission_id)
            logs = self.jobs.logs(submission_id)
            new = logs[logged:] if status in TERMINAL else logs[logged: logs.rfind("\n") + 1]
            for line in new.splitlines():
                self.log.info("[ray job] %s", line)
            logged += len(new)
            if status in TERMINAL:
                return self._finish(submission_id, status, message, logs)
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        self.submission_id = event["submission_id"]
        if event["status"] == "ERROR":
            raise AirflowException(event["message"])
        return self._finish(event["submission_id"], event["status"], event["message"], self.jobs.logs(event["submission_id"]))

    def _finish(self, submission_id: str, status: str, message: str, logs: str) -> Any:
        if status == "SUCCEEDED":
            return last_result(logs)
        tail = "\n".join(logs.splitlines()[-LOG_TAIL_LINES:])
        raise AirflowException(
            f"Ray job {submission_id} {status}: {message}\n--- last {LOG_TAIL_LINES} log lines ---\n{tail}"
        )

    def _result(self, submission_id: str) -> Any:
        return last_result(self.jobs.logs(submission_id))

    def on_kill(self) -> None:
        if self.submission_id:
            self.log.info("Task killed: stopping Ray job %s", self.submission_id)
            self.jobs.stop(self.submission_id)
