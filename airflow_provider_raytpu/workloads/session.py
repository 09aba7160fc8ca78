"""Connect a job driver to its Ray cluster, passing on to its workers what they need: the storage
emulator's settings, and the settings that keep the job's log readable in an Airflow task log."""

from __future__ import annotations

import json
import logging
import os

from airflow_provider_raytpu.workloads.storage import emulator_env

# Ray Train's record of each report, logged by every worker: "Reporting training result 3: TrainingReport(...)".
_REPORT_RECORD = "Reporting training result "
# Set by Ray's job manager in a submitted job's driver; holds the job's runtime_env.
_JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
READABLE_LOG_ENV = {
    # Ray Train logs every print() of a train worker through the root logger and also tees it to
    # stdout, so each line of a train loop reached the job log twice.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}


def _job_env_vars() -> dict[str, str]:
    try:
        config = json.loads(os.environ.get(_JOB_CONFIG_VAR, "") or "{}")
    except ValueError:
        return {}
    return dict((config.get("runtime_env") or {}).get("env_vars") or {})


def worker_env_vars() -> dict[str, str]:
    """Environment variables this driver must add to its workers' runtime_env.

    :data:`READABLE_LOG_ENV` and the emulator variables (none in production), minus those the
    submitted job's own runtime_env already sets: Ray refuses to merge a key set in both places,
    and the job's own choice wins.
    """
    job = _job_env_vars()
    return {k: v for k, v in {**READABLE_LOG_ENV, **emulator_env()}.items() if k not in job}


def connect() -> bool:
    """Connect to the Ray cluster (``RAY_ADDRESS``, or the cluster of a submitted job).

    Returns ``True`` when this call connected (so the caller should disconnect) and
    ``False`` when Ray was already initialised in this process.
    """
    import ray

    if ray.is_initialized():
        return False
    from ray.data import DataContext

    ray.init(runtime_env={"env_vars": worker_env_vars()}, log_to_driver=True)
    # Ray Data's progress in Ray actors (a Train run's dataset shards): the line Ray logs every
    # RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL s when nobody watches a terminal, not a bar redrawn
    # every second, one job log line per redraw. Datasets made after this carry the setting.
    DataContext.get_current().use_ray_tqdm = False
    return True


class _NoReportRecords(logging.Filter):
    """Drops Ray Train's per-report record (:data:`_REPORT_RECORD`) of one logger."""

    def __init__(self, logger_name: str) -> None:
        super().__init__()
        self.logger_name = logger_name

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == self.logger_name and str(record.msg).startswith(_REPORT_RECORD))


def quiet_report_records() -> None:
    """In a Ray Train worker: keep Ray Train's record of each report off the console (the job's log).

    Every worker logs ``Reporting training result N: TrainingReport(<metrics>) from rank R``
    for every report, so the task log showed each checkpointed step once per worker, with the
    whole metrics dict. The record stays in Ray Train's worker log file (Ray dashboard, Logs);
    only the console handler Ray Train gives the root logger drops it.
    """
    try:
        from airflow_provider_raytpu.workloads.ray_compat import PlainRayHandler
        from airflow_provider_raytpu.workloads.ray_compat import train_context as context
    except ImportError:  # a Ray without Train v2's context: nothing to quiet
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PlainRayHandler) and not any(isinstance(f, _NoReportRecords) for f in handler.filters):
            handler.addFilter(_NoReportRecords(context.logger.name))
