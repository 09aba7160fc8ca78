"""Connect a job driver to its Ray cluster, passing the storage emulator's settings on to workers."""

from __future__ import annotations

import json
import os

from airflow_provider_raytpu.workloads.storage import emulator_env

# Set by Ray's job manager in a submitted job's driver; holds the job's runtime_env.
_JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _job_env_vars() -> dict[str, str]:
    try:
        config = json.loads(os.environ.get(_JOB_CONFIG_VAR, "") or "{}")
    except ValueError:
        return {}
    return dict((config.get("runtime_env") or {}).get("env_vars") or {})


def worker_env_vars() -> dict[str, str]:
    """Environment variables this driver must add to its workers' runtime_env.

    The emulator variables (empty in production), minus those the submitted job's own
    runtime_env already sets: Ray refuses to merge a key set in both places.
    """
    job = _job_env_vars()
    return {k: v for k, v in emulator_env().items() if k not in job}


def connect() -> bool:
    """Connect to the Ray cluster (``RAY_ADDRESS``, or the cluster of a submitted job).

    Returns ``True`` when this call connected (so the caller should disconnect) and
    ``False`` when Ray was already initialised in this process.
    """
    import ray

    if ray.is_initialized():
        return False
    env_vars = worker_env_vars()
    ray.init(runtime_env={"env_vars": env_vars} if env_vars else None, log_to_driver=True)
    return True
