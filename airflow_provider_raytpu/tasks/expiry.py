"""How long a RayCluster may live: ``max_lifetime``, bounded by a flex-start slice's run, renewed on adoption;
and what keeps an expired one (:func:`kept_because`), for the sweep of expired clusters.

The sweep fails closed: a cluster is deleted only when it is known to be unused. What cannot be checked (the DAG
run's state cannot be read, the Ray jobs cannot be listed on a ready head) keeps the cluster, and says why.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.hooks.ray_jobs import ACTIVE, RayJobsHook
from airflow_provider_raytpu.manifests.raycluster import DAG_ID_KEY, DEPLOYMENT_KEY, EXPIRES_AT_ANNOTATION, RUN_ID_KEY
from airflow_provider_raytpu.progress import TaskLog
from airflow_provider_raytpu.status import read_ray_cluster
from airflow_provider_raytpu.values import parse_duration

if TYPE_CHECKING:
    from airflow.sdk.types import RuntimeTaskInstanceProtocol

    from airflow_provider_raytpu.backends.base import ClusterBackend
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

#: Seconds the sweep of expired clusters tries to list a cluster's Ray jobs.
JOB_CHECK_GRACE_SECONDS = 5.0


def parse_lifetime(value: Any) -> timedelta:
    """``max_lifetime`` as a ``timedelta``: given as one, or as seconds; more than zero.

    :raises InvalidInputError: not a duration, or not positive.
    """
    return parse_duration(value, "max_lifetime", example="timedelta(hours=24)",
                          why_positive=": the cluster would be expired when it is made")


def renew_expiry(backend: ClusterBackend, log: TaskLog, stored: dict[str, Any], manifest: dict[str, Any]) -> None:
    """A create that adopts its cluster (a retry, a Clear the next day) renews the cluster's expiry from now:
    the sweep of expired clusters must not delete it mid-run."""
    metadata = stored.get("metadata") or {}
    name, namespace = metadata["name"], metadata["namespace"]
    renewed = manifest["metadata"]["annotations"][EXPIRES_AT_ANNOTATION]
    recorded = (metadata.get("annotations") or {}).get(EXPIRES_AT_ANNOTATION)
    if recorded == renewed:
        return
    backend.annotate_cluster(name, namespace, {EXPIRES_AT_ANNOTATION: renewed})
    log.info("RayCluster %s/%s adopted: its expiry is renewed from %s to %s", namespace, name, recorded, renewed)


def run_gone(exc: Exception) -> bool:
    """Whether a DAG run lookup failed because the run does not exist (the execution API's 404), not because
    the lookup itself failed. A worker's task process gets the 404 from its supervisor (``AirflowRuntimeError``
    whose detail has the status); ``dag.test()`` calls the API in process (``ServerResponseError``, an httpx
    error with the response)."""
    detail = getattr(getattr(exc, "error", None), "detail", None)
    status = detail.get("status_code") if isinstance(detail, dict) else None
    return (status or getattr(getattr(exc, "response", None), "status_code", None)) == 404


def run_in_progress(ti: RuntimeTaskInstanceProtocol, cluster: dict[str, Any]) -> str | None:
    """Why the DAG run that made ``cluster`` keeps it: it runs or is queued, or its state cannot be read."""
    notes = cluster["metadata"].get("annotations") or {}
    if DAG_ID_KEY not in notes or RUN_ID_KEY not in notes:
        return None
    dag_id, run_id = notes[DAG_ID_KEY], notes[RUN_ID_KEY]
    try:
        found = ti.get_dagrun_state(dag_id, run_id)
    except Exception as exc:
        if run_gone(exc):  # the run was deleted: nobody waits for the cluster
            return None
        return f"the state of its DAG run {dag_id} / {run_id} could not be read ({exc}); kept until it can"
    state = str(getattr(found, "value", found))  # the Task SDK's DagRunState enum
    return f"its DAG run {dag_id} / {run_id} is {state}" if state in ("running", "queued") else None


def jobs_running(hook: RayTpuHook, cluster: dict[str, Any], log: TaskLog) -> str | None:
    """Why Ray jobs keep ``cluster``: some run, or its ready head's jobs cannot be listed. A cluster without a
    ready head runs no Ray job (drivers run on the head, and KubeRay marks it not ready when its raylet or
    GCS fails), so its jobs are not asked for."""
    metadata = cluster["metadata"]
    if not read_ray_cluster(cluster).head_ready:
        log.info("RayCluster %s/%s: its head is not ready, so no Ray job runs there", metadata["namespace"],
                 metadata["name"])
        return None
    jobs = RayJobsHook(metadata["name"], metadata["namespace"], hook.raytpu_conn_id, cluster_hook=hook,
                       unreachable_grace_period=JOB_CHECK_GRACE_SECONDS)
    try:
        running = [job.submission_id or job.job_id or "" for job in jobs.list_jobs() if job.status in ACTIVE]
    except Exception as exc:
        return (f"its Ray jobs could not be listed ({exc}); kept until they can. The connection's identity needs "
                f"'create' on services/proxy in namespace {metadata['namespace']} (docs/gke.md, 'RBAC')")
    return f"Ray job(s) {', '.join(running)} still running on it" if running else None


def made_elsewhere(hook: RayTpuHook, cluster: dict[str, Any]) -> str | None:
    """Why another Airflow deployment's cluster is not this sweep's: its DAG runs are not this deployment's."""
    made_by = (cluster["metadata"].get("annotations") or {}).get(DEPLOYMENT_KEY)
    if made_by is None or made_by == hook.deployment:
        return None
    return (f"Airflow deployment {made_by!r} made it (this is {hook.deployment!r}): its DAG runs are not this "
            "deployment's to read, so that deployment's own sweep deletes it")


def kept_because(ti: RuntimeTaskInstanceProtocol, hook: RayTpuHook, cluster: dict[str, Any],
                 log: TaskLog) -> str | None:
    """Why an expired cluster must stay (another deployment made it, its DAG run goes on, a Ray job runs, or
    either cannot be checked), or ``None`` when it is known to be unused."""
    return made_elsewhere(hook, cluster) or run_in_progress(ti, cluster) or jobs_running(hook, cluster, log)
