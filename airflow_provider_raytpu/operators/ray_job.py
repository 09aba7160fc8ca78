"""Run a Ray job on an existing cluster; retries reattach instead of starting a second job."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_raytpu.dashboard.job_log import (
    JobError,
    JobLogFollower,
    closing_line,
    job_error,
    job_message,
    returned,
    shown_entrypoint,
    shown_tail,
)
from airflow_provider_raytpu.dashboard.outage import DEFAULT_UNREACHABLE_GRACE
from airflow_provider_raytpu.hooks.ray_jobs import ACTIVE, JobIdentity, RayJobsHook
from airflow_provider_raytpu.tasks.base import (
    check_literal,
    check_not_empty,
    default_deferrable,
    fail_fast,
    mask_secret_values,
)
from airflow_provider_raytpu.tasks.cluster_ready import ClusterReadyWait
from airflow_provider_raytpu.tasks.job_tries import job_identity, same_cycle, stop_leftovers, will_be_retried
from airflow_provider_raytpu.tasks.links import RayJobLink, dashboard_url, push_link
from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger, seal_secrets
from airflow_provider_raytpu.values import duration_seconds
from airflow_provider_raytpu.workloads.result import EXIT_BAD_INPUT, last_result

if TYPE_CHECKING:
    from airflow.sdk import BaseOperatorLink, Context

    from airflow_provider_raytpu.dashboard.jobs import JobRecord
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

LOG_TAIL_LINES = 50
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: Seconds a task that gave up on an unreachable dashboard tries to stop its job on its last try.
STOP_ON_GIVE_UP_GRACE = 30.0


class SubmitRayJobOperator(ClusterReadyWait, BaseOperator):
    """Run a command as a Ray job on a RayCluster and wait for it, streaming its log.

    Every submission carries its task try as metadata and a deterministic submission
    id. On an Airflow retry the operator finds this task's jobs, newest try first: a
    pending or running job is reattached to (never a second job), a succeeded one
    returns its result without rerunning, a failed or stopped one is submitted again
    (and resumes from its checkpoints, when it keeps any). A user's Clear starts over
    (told apart from a retry by the ``max_tries`` Airflow records on the task instance, not
    by today's ``retries``: :mod:`~airflow_provider_raytpu.tasks.job_tries`).
    Before any new submission, jobs of this task still pending or running are stopped and
    waited for, so two drivers never share a run directory or a slice.

    While the cluster's dashboard (or the API server proxying it) is unreachable, every
    request is tried again for ``unreachable_grace_period`` seconds, with a line at least
    every 10 s saying what is unreachable; the job runs on meanwhile. After that the task
    fails and Airflow decides: a try that will be retried leaves the job running (the retry
    reattaches to it); the last try stops it.

    A cluster that is not READY yet (e.g. re-created by a cleared setup task) is waited for,
    with its progress in the log (deferred to the triggerer when deferrable), up to
    ``cluster_ready_timeout`` seconds; a FAILED one fails the task. READY means what the connection's
    ``confirm_with_ray`` says (:class:`~airflow_provider_raytpu.sensors.raycluster.RayClusterReadySensor`).

    The job reports its result by printing ``RAYTPU_RESULT <json>``
    (``airflow_provider_raytpu.workloads.result.report_result``); the last such line
    is the task's return value. A failed job fails the task with its last 50 log lines;
    a job whose driver exits with code 2 (bad input: a typo in an import path, a missing
    column) fails it without retries.

    :param cluster: the cluster reference (``create.output``), instead of ``cluster_name``.
    :param cluster_name: the RayCluster's name.
    :param entrypoint: the command, as a string or a list of arguments (joined with ``shlex.join``).
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param runtime_env: Ray runtime_env (working_dir, py_modules, env_vars, pip).
    :param ship_provider: add this provider's package to ``py_modules``, so entrypoints can
        run ``python -m airflow_provider_raytpu.workloads...`` on a stock Ray image.
    :param entrypoint_num_cpus: CPUs reserved for the driver.
    :param entrypoint_resources: custom resources reserved for the driver.
    :param metadata: extra job metadata.
    :param deferrable: wait in the triggerer instead of a worker slot; default:
        ``[operators] default_deferrable``.
    :param poll_interval: how long between status polls (a ``timedelta`` or seconds, as every duration here).
    :param cluster_ready_timeout: how long to wait for a cluster that is not READY.
    :param unreachable_grace_period: how long the dashboard may be unreachable before the task gives up.
    """

    template_fields: Sequence[str] = (
        "cluster",
        "cluster_name",
        "namespace",
        "raytpu_conn_id",
        "entrypoint",
        "runtime_env",
        "entrypoint_resources",
        "metadata",
    )
    template_fields_renderers = {"runtime_env": "json", "metadata": "json"}
    operator_extra_links: tuple[BaseOperatorLink, ...] = (RayJobLink(),)
    ui_color = "#fef7e0"
    # The entrypoint a subclass builds in execute() is shown in the rendered-template view.
    overwrite_rtif_after_execution = True
    #: Whether the operator builds its command itself (:meth:`prepare_entrypoint`), so ``entrypoint`` may be empty.
    builds_entrypoint = False

    def __init__(
        self,
        *,
        entrypoint: str | Sequence[str],
        cluster: Any = None,
        cluster_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        ship_provider: bool = True,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
        deferrable: bool | None = None,
        poll_interval: timedelta | float = 2.0,
        cluster_ready_timeout: timedelta | float = 3600.0,
        unreachable_grace_period: timedelta | float = DEFAULT_UNREACHABLE_GRACE,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if cluster is None and cluster_name is None:
            raise TypeError(f"{type(self).__name__} needs cluster=<create task>.output or cluster_name=...")
        if not self.builds_entrypoint:
            check_literal(entrypoint, lambda value: check_not_empty(value, "entrypoint", "['python', 'job.py']"))
        self.cluster = cluster
        self.cluster_name = cluster_name
        self.entrypoint = entrypoint
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.runtime_env = runtime_env
        self.ship_provider = ship_provider
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_resources = entrypoint_resources
        self.metadata = metadata
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.poll_interval = duration_seconds(poll_interval, "poll_interval", example="2")
        self.cluster_ready_timeout = duration_seconds(cluster_ready_timeout, "cluster_ready_timeout",
                                                      example="timedelta(hours=1)")
        self.unreachable_grace_period = duration_seconds(unreachable_grace_period, "unreachable_grace_period",
                                                         example="120", allow_zero=True)
        self.submission_id: str | None = None
        #: The result of the job this task followed to success, when a mapping (what its lineage reports).
        self.job_result: Mapping[str, Any] = {}
        self.job_args: list[str] | None = None

    @cached_property
    def jobs(self) -> RayJobsHook:
        """The Ray Jobs API of the cluster, through the task's one backend."""
        return RayJobsHook(self.resolved_name(), self.resolved_namespace(), self.conn_id,
                           cluster_hook=self.hook, unreachable_grace_period=self.unreachable_grace_period)

    def prepare_entrypoint(self, context: Context) -> None:
        """Build the command once the cluster is READY (a subclass sets :attr:`job_args` here)."""

    def entrypoint_command(self) -> str:
        """The command submitted: :attr:`job_args` when built, else ``entrypoint`` as given."""
        if self.job_args is not None:
            return shlex.join(self.job_args)
        if isinstance(self.entrypoint, str):
            return self.entrypoint
        return shlex.join(str(arg) for arg in self.entrypoint)

    def show_entrypoint(self, command: str) -> None:
        """Show ``command`` as the rendered entrypoint; JSON arguments that may hold secrets by their keys only."""
        self.entrypoint = shown_entrypoint(command)

    def secret_mappings(self) -> list[Mapping[str, Any] | None]:
        """What may hold secrets by its keys: the job's environment variables (a subclass adds its own)."""
        return [(self.runtime_env or {}).get("env_vars")]

    def mask_secrets(self) -> list[str]:
        """Register the task's secret values with Airflow's masker in this process (the worker that submits, and
        the one that resumes after a deferral); the values, for the trigger to register in the triggerer."""
        return [secret for values in self.secret_mappings() for secret in mask_secret_values(values)]

    def job_runtime_env(self) -> dict[str, Any]:
        env = dict(self.runtime_env or {})
        if self.ship_provider:
            modules = list(env.get("py_modules") or [])
            if str(PACKAGE_DIR) not in modules:
                env["py_modules"] = [*modules, str(PACKAGE_DIR)]
        return env

    @contextlib.contextmanager
    def _task_clients(self) -> Iterator[None]:
        """The task's one backend, closed when the task (or this part of it) ends."""
        try:
            yield
        finally:
            if "hook" in self.__dict__ and "backend" in self.hook.__dict__:
                self.hook.backend.close()

    @property
    def ready_timeout(self) -> float:
        return self.cluster_ready_timeout

    def execute(self, context: Context) -> Any:
        with self._task_clients():
            self.wait_until_ready(self.poll_interval, "execute_when_ready")
            return self._run(context)

    def execute_when_ready(self, context: Context, event: dict[str, Any]) -> Any:
        """Back from waiting in the triggerer for the cluster to be READY."""
        with self._task_clients():
            self.ready_from_event(event)
            return self._run(context)

    def _run(self, context: Context) -> Any:
        secrets = self.mask_secrets()
        with fail_fast():
            sealed = seal_secrets(secrets) if self.deferrable else None
            self.prepare_entrypoint(context)
            command = self.entrypoint_command()
            self.show_entrypoint(command)
            identity = job_identity(context)
            jobs = self.jobs
            previous = jobs.find_jobs(identity)
        submission_id = self._reattach_or_resubmit(context, identity, previous, command)
        if submission_id is None:
            succeeded = previous[0].submission_id
            assert succeeded is not None  # find_jobs matches metadata that only a submitted job carries
            return self._result(succeeded)
        self.submission_id = submission_id
        self._persist_link(context, submission_id)
        trigger = RayJobTrigger(
            submission_id=submission_id,
            cluster_name=jobs.cluster_name,
            namespace=jobs.namespace,
            raytpu_conn_id=self.conn_id,
            poll_interval=self.poll_interval,
            unreachable_grace_period=self.unreachable_grace_period,
            sealed_secrets=sealed,
        )
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        return self._job_ended(context, follow_here(trigger, self.hook))

    def _give_up(self, context: Context, submission_id: str, reason: str) -> NoReturn:
        """Stop following the job: leave it running for a retry to reattach to, or stop it on the last try."""
        if will_be_retried(context):
            raise AirflowException(f"{reason}\nGave up following Ray job {submission_id}; it was not stopped: the "
                                   f"next try reattaches to it if it still runs")
        self.log.warning("Stopping Ray job %s: this was the task's last try", submission_id)
        stopper = RayJobsHook(self.jobs.cluster_name, self.jobs.namespace, self.conn_id, cluster_hook=self.hook,
                              unreachable_grace_period=STOP_ON_GIVE_UP_GRACE)
        try:
            stopper.stop(submission_id)
        except Exception as exc:  # the dashboard is still unreachable: the teardown ends the job with its cluster
            self.log.warning("Could not stop Ray job %s: %s", submission_id, exc)
        raise AirflowException(f"{reason}\nGave up following Ray job {submission_id} on the task's last try")

    def _reattach_or_resubmit(self, context: Context, identity: JobIdentity, previous: list[JobRecord],
                              command: str) -> str | None:
        """The job to follow: reattached, or newly submitted; ``None`` when the newest already succeeded."""
        if previous and same_cycle(previous[0], context):
            newest = previous[0]
            status = newest.status
            if status in ACTIVE:
                self.log.info("Reattaching to Ray job %s (%s) from try %s", newest.submission_id, status,
                              (newest.metadata or {}).get("raytpu.try_number"))
                return newest.submission_id
            if status == "SUCCEEDED":
                self.log.info("Ray job %s already succeeded; returning its result", newest.submission_id)
                return None
            self.log.info("Ray job %s ended %s; submitting try %s", newest.submission_id, status, identity.try_number)
        stop_leftovers(self.jobs, previous, self.log, self.poll_interval)
        submission_id = self.jobs.submit(
            identity,
            command,
            runtime_env=self.job_runtime_env(),
            entrypoint_num_cpus=self.entrypoint_num_cpus,
            entrypoint_resources=self.entrypoint_resources,
            metadata=self.metadata,
        )
        self.log.info("Submitted Ray job %s: %s", submission_id, self.entrypoint)
        return submission_id

    def _persist_link(self, context: Context, submission_id: str) -> None:
        push_link(context, RayJobLink, dashboard_url(self.jobs.dashboard, f"jobs/{submission_id}"))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        self.mask_secrets()  # a new process: what the submitting one registered is not registered here
        with self._task_clients():
            return self._job_ended(context, event)

    def _job_ended(self, context: Context, event: dict[str, Any]) -> Any:
        """The task's outcome from the event of the job's :class:`RayJobTrigger` (followed here or in the
        triggerer)."""
        self.submission_id = event["submission_id"]
        if event["status"] == "ERROR":
            self._give_up(context, event["submission_id"], event["message"])
        self.show_entrypoint(self.jobs.info(self.submission_id).entrypoint or "")
        if event["status"] == "SUCCEEDED" and "result" in event:  # the trigger read the whole log
            return self._succeeded(event["submission_id"], event["result"])
        if "error" in event:
            return self._finish(event["submission_id"], event["status"], event["message"], "",
                                JobError(**event["error"]))
        logs = event.get("log_tail") if event["status"] != "SUCCEEDED" else None
        return self._finish(event["submission_id"], event["status"], event["message"],
                            logs if logs is not None else self.jobs.logs(event["submission_id"]))

    def _finish(self, submission_id: str, status: str, message: str, logs: str, error: JobError | None = None) -> Any:
        """The task's outcome from how the job ended.

        :param logs: the job's log, or its end.
        :param error: the exception the job's driver ended with, when the trigger read it (else read from ``logs``).
        """
        if status == "SUCCEEDED":
            return self._succeeded(submission_id, last_result(logs))
        message = job_message(message) or "no message"
        error = error or job_error(logs)
        self.log.error("%s", closing_line(submission_id, status, self.jobs.wall_seconds(submission_id),
                                          error.exception if error else message))
        if error is not None:  # the traceback is the log's end, just above: not repeated here
            text = (f"Ray job {submission_id} {status}: {error.exception}\n  at {error.where}\n"
                    f"(its traceback ends the job's log above; Ray: {message})")
        else:
            text = (f"Ray job {submission_id} {status}: {message}\n--- last {LOG_TAIL_LINES} log lines ---\n"
                    f"{shown_tail(logs, LOG_TAIL_LINES)}")
        if status == "FAILED" and self.jobs.info(submission_id).driver_exit_code == EXIT_BAD_INPUT:
            raise AirflowFailException(f"{text}\nThe job exited with code {EXIT_BAD_INPUT} (bad input): not retried")
        raise AirflowException(text)

    def after_job(self, result: Any) -> None:
        """What a subclass logs after the closing line of a job that succeeded (training: its step times).

        :param result: the job's result.
        """

    def _succeeded(self, submission_id: str, result: Any, note: str = "") -> Any:
        """The closing line of a job that succeeded, then what a subclass adds; the task's return value."""
        self.log.info("%s", closing_line(submission_id, "SUCCEEDED", self.jobs.wall_seconds(submission_id),
                                         returned(result) + note))
        self.job_result = result if isinstance(result, Mapping) else {}
        self.after_job(result)
        return result

    def _result(self, submission_id: str) -> Any:
        """An earlier try's job that succeeded: its log again, marked (the earlier try may have shown part of it
        before it was lost), so the try that sees the job's end shows all of it; then its result."""
        logs = self.jobs.logs(submission_id)
        for line in JobLogFollower().shown(logs):
            self.log.info("[ray job, again] %s", line)
        return self._succeeded(submission_id, last_result(logs), " (an earlier try's job)")

    def on_kill(self) -> None:
        if self.submission_id:
            self.log.info("Task killed: stopping Ray job %s", self.submission_id)
            self.jobs.stop(self.submission_id)


def follow_here(trigger: RayJobTrigger, hook: RayTpuHook | None = None) -> dict[str, Any]:
    """Follow a job in this process as the triggerer would (its status from the cluster's job list, its log
    from Ray's streaming tail, each line written once): a task that does not defer transfers its log once,
    not the whole log every ``poll_interval``; the trigger's event.

    :param hook: the task's connection hook, whose backend the follower uses (none: the follower makes its own).
    """

    async def first_event() -> dict[str, Any]:
        if hook is not None:
            await hook.lend_backend(hook.backend)
        async for event in trigger.run():
            return dict(event.payload)
        raise RuntimeError(f"The follower of Ray job {trigger.submission_id} ended without an event")

    return asyncio.run(first_event())
