"""Which tries of a task a Ray job belongs to: a retry goes on with its cycle's job, a Clear starts anew.

Airflow records ``max_tries`` on each task instance. A retry leaves it alone; a user's Clear of
a task that is not running sets it to ``try_number + retries`` (``clear_task_instances`` in
airflow/models/taskinstance.py). So ``max_tries`` names the cycle of tries a try belongs to,
whatever the DAG file says ``retries`` is today: lowering ``retries`` while a run is in
flight does not make a retry look like a Clear. Every job records the ``max_tries`` of the
try that submitted it (``raytpu.max_tries``); a later try with the same ``max_tries`` goes on
with that job (reattaches, returns its result, or resubmits and resumes), a try with another
one stops it and starts over. Whether a failed try is retried is Airflow's rule too
(``_is_eligible_to_retry`` in the execution API): ``max_tries != 0 and try_number <= max_tries``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from airflow.sdk.exceptions import AirflowException

from airflow_provider_raytpu.compat import never_expire
from airflow_provider_raytpu.hooks.ray_jobs import ACTIVE, METADATA_PREFIX, TERMINAL, JobIdentity, RayJobsHook
from airflow_provider_raytpu.progress import LogPace, TaskLog
from airflow_provider_raytpu.tasks.base import map_index_of

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_raytpu.dashboard.jobs import JobRecord

MAX_TRIES_KEY = f"{METADATA_PREFIX}max_tries"
RUN_TOKEN_KEY = "raytpu.run_token"
STOP_TIMEOUT_SECONDS = 120.0


def run_token(context: Context) -> str:
    """This DAG run's token: the same for every try and Clear of the task in the run, another for a run
    deleted and created again with the same run id. Made at the task's first try, kept in the task state
    store for as long as the run exists."""
    store = context["task_state_store"]
    token = store.get(RUN_TOKEN_KEY)
    if not isinstance(token, str) or not token:
        token = uuid.uuid4().hex[:12]
        store.set(RUN_TOKEN_KEY, token, retention=never_expire())
    return token


def job_identity(context: Context) -> JobIdentity:
    """The task try a job submitted now belongs to, with its cycle (``max_tries``) and its DAG run's token."""
    ti = context["ti"]
    return JobIdentity(ti.dag_id, ti.task_id, ti.run_id, map_index_of(context), ti.try_number, ti.max_tries,
                       run_token(context))


def same_cycle(job: JobRecord, context: Context) -> bool:
    """Whether a job of this task was submitted in this try's cycle (no Clear since).

    :param job: Ray's record of one of this task's jobs.
    """
    recorded = (job.metadata or {}).get(MAX_TRIES_KEY)
    return recorded is None or int(recorded) == context["ti"].max_tries  # None: from an earlier release


def will_be_retried(context: Context) -> bool:
    """Whether Airflow retries this try when it fails (with an error that is not an ``AirflowFailException``)."""
    ti = context["ti"]
    return ti.max_tries != 0 and ti.try_number <= ti.max_tries


def stop_leftovers(jobs: RayJobsHook, previous: list[JobRecord], log: TaskLog, poll_interval: float) -> None:
    """Stop this task's jobs still pending or running, and wait until each has ended (before a new
    submission: two drivers never share a run directory or a slice).

    :param jobs: the cluster's Jobs API.
    :param previous: Ray's records of this task's jobs.
    :param log: the task's logger.
    :param poll_interval: seconds between status reads (at most 1).
    """
    leftovers = [job.submission_id for job in previous if job.status in ACTIVE and job.submission_id is not None]
    for submission_id in leftovers:
        log.warning("Stopping Ray job %s left running by an earlier run of this task", submission_id)
        jobs.stop(submission_id)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    pace = LogPace()
    for submission_id in leftovers:
        while (status := jobs.status(submission_id)[0]) not in TERMINAL:
            if time.monotonic() > deadline:
                raise AirflowException(f"Ray job {submission_id} is still {status} {STOP_TIMEOUT_SECONDS:.0f} s "
                                       "after it was asked to stop; not submitting a second driver next to it")
            if pace.due(status):
                log.info("Waiting for Ray job %s to stop: %s (%.0f s)", submission_id, status, pace.elapsed)
            time.sleep(min(poll_interval, 1.0))
        log.info("Ray job %s ended %s", submission_id, status)
