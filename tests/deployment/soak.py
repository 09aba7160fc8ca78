"""What the fault soak needs beside the deployment: a Kubernetes API (the fake one, over HTTP) whose every
head service proxies to one real local Ray cluster, the faults, and the invariants checked after each run.

The DAG (``dags/raytpu_soak.py``) uses the connection ``raytpu_soak``: backend kubernetes, through a
cncf-kubernetes connection to that API. KubeRay is played by the fake's reactor; the jobs run for real
on the local cluster, reached through the API server's service proxy, as on GKE.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from airflow_provider_raytpu.manifests.raycluster import RUN_ID_KEY
from tests.deployment.deployment import AirflowDeployment
from tests.deployment.rest import AirflowApi
from tests.support.fake_apiserver.server import FakeKubeApiServer

DAG_ID = "raytpu_soak"
NAMESPACE = "soak"
SECRET = "sk-soak-7f3e9a2b4c6d8e0f"  # the DAG's --config wandb_api_key
TICKS = 40
TICK = re.compile(r"\btick (\d{4})\b")
AGAIN = "[ray job, again]"
FOLLOWED = ("job", "sync_job")
TASKS = ("create_cluster", "wait_ready", "job", "sync_job", "failing_job", "delete_cluster")


@dataclass
class Soak:
    """The soak's world: the deployment, its API, the fake Kubernetes API and the real Ray dashboard."""

    deployment: AirflowDeployment
    api: AirflowApi
    kube: FakeKubeApiServer
    dashboard: str
    bystander: dict[str, Any]
    #: Per scenario: the fault injected and when, and the invariants checked.
    record: list[dict[str, Any]] = field(default_factory=list)

    def ray_jobs(self, run_id: str) -> list[dict[str, Any]]:
        """The Ray jobs the run's tasks submitted, as the dashboard lists them."""
        jobs = httpx.get(f"{self.dashboard}/api/jobs/", timeout=30).json()
        return [job for job in jobs if (job.get("metadata") or {}).get("raytpu.run_id") == run_id]

    def running(self, run_id: str, task_id: str) -> list[dict[str, Any]]:
        return [job for job in self.ray_jobs(run_id)
                if job["metadata"].get("raytpu.task_id") == task_id and job["status"] == "RUNNING"]


def ticks(lines: Iterable[str]) -> list[int]:
    return [int(match.group(1)) for line in lines if (match := TICK.search(line))]


def violations(soak: Soak, run_id: str, *, jobs_ran: bool = True) -> list[str]:
    """Every invariant the finished run broke (empty: all held).

    :param jobs_ran: whether the run's job tasks ran (not when its create failed): else it must have no job.
    """
    found: list[str] = []
    kube, api = soak.kube, soak.api
    # No other run's object touched (KubeRay, played by the reactor, writes its status: that is not a touch).
    bystander = kube.get_object("rayclusters", NAMESPACE, "bystander")
    written = sum(kube.count(method, r"/rayclusters/bystander(/|$)") for method in ("PUT", "PATCH", "DELETE"))
    if bystander is None or written or any(bystander["metadata"].get(key) != soak.bystander["metadata"].get(key)
                                           for key in ("uid", "labels", "annotations")):
        found.append(f"another DAG's RayCluster was written ({written} writes) or deleted: {bystander}")
    # No cluster left after the teardown.
    left = [c["metadata"]["name"] for c in kube.list_objects("rayclusters", NAMESPACE)
            if (c["metadata"].get("annotations") or {}).get(RUN_ID_KEY) == run_id]
    if left:
        found.append(f"RayClusters of the run left after its teardown: {left}")
    # No duplicate Ray job: per task, no two jobs at once, and one that succeeded.
    jobs = soak.ray_jobs(run_id)
    if not jobs_ran:
        return found + [f"a Ray job of a run whose jobs never ran: {j['submission_id']}" for j in jobs] + [
            f"a secret in {where}" for where, text in readable(soak, run_id) if SECRET in text or kube.token in text]
    for task_id in (*FOLLOWED, "failing_job"):
        mine = sorted((j for j in jobs if j["metadata"]["raytpu.task_id"] == task_id), key=lambda j: j["start_time"])
        for earlier, later in zip(mine, mine[1:], strict=False):
            if earlier.get("end_time") is None or later["start_time"] < earlier["end_time"]:
                found.append(f"{task_id}: Ray jobs {earlier['submission_id']} and {later['submission_id']} ran at once")
        expected = ("FAILED",) if task_id == "failing_job" else ("SUCCEEDED",)
        if [j["status"] for j in mine if j["status"] in ("SUCCEEDED", "FAILED")][-1:] != list(expected):
            found.append(f"{task_id}: Ray jobs {[(j['submission_id'], j['status']) for j in mine]}")
    # Each job log line once in every try's log (a line a killed triggerer may not have written is written
    # again, marked: those may repeat), and every line in the try that saw the job end.
    for task_id in FOLLOWED:
        tries = api.tries(DAG_ID, run_id, task_id)
        for attempt in tries:
            seen = ticks(line for line in api.log(DAG_ID, run_id, task_id, attempt["try_number"])
                         if AGAIN not in line)
            if len(seen) != len(set(seen)):
                found.append(f"{task_id} try {attempt['try_number']}: a line written twice: {seen}")
        last = ticks(api.log(DAG_ID, run_id, task_id, tries[-1]["try_number"]))
        if sorted(set(last)) != list(range(1, TICKS + 1)):
            found.append(f"{task_id}: the last try's log lacks lines: {last}")
    # No secret in any task log, XCom, stored trigger event or component log.
    for where, text in readable(soak, run_id):
        for secret in (SECRET, kube.token):
            if secret in text:
                found.append(f"a secret in {where}")
    return found


def readable(soak: Soak, run_id: str) -> list[tuple[str, str]]:
    """Everything of the run a user or operator can read: task logs (every try), XComs, the trigger events
    Airflow stores for a resumed task (``next_kwargs``), and every component's log."""
    api = soak.api
    texts = []
    for task_id in TASKS:
        for attempt in api.tries(DAG_ID, run_id, task_id):
            if attempt["try_number"]:
                texts.append((f"{task_id} try {attempt['try_number']}'s log",
                              "\n".join(api.log(DAG_ID, run_id, task_id, attempt["try_number"]))))
        texts.append((f"{task_id}'s XComs", json.dumps(api.xcoms(DAG_ID, run_id, task_id))))
    with sqlite3.connect(f"file:{soak.deployment.home}/airflow.db?mode=ro", uri=True) as db:
        for table in ("task_instance", "task_instance_history"):
            rows = db.execute(f"SELECT task_id, next_kwargs FROM {table} WHERE dag_id = ? AND run_id = ?",  # noqa: S608
                              (DAG_ID, run_id)).fetchall()
            texts += [(f"{table}.next_kwargs of {task_id}", str(kwargs)) for task_id, kwargs in rows]
    texts += [(f"component log {log.name}", log.read_text(errors="replace"))
              for log in sorted(soak.deployment.log_dir.glob("*.log"))]
    return texts
