"""Follow a Ray job from the triggerer: stream its new log lines, fire when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from airflow_provider_raytpu.hooks.ray_jobs import TERMINAL, RayJobsHook

TRANSIENT_FAILURES_ALLOWED = 10


class RayJobTrigger(BaseTrigger):
    """Poll one Ray job; log each new line once, as it appears; fire on SUCCEEDED, FAILED or STOPPED.

    Killing the task (mark failed, clear) stops the Ray job through :meth:`on_kill`.

    :param submission_id: the Ray job's submission id.
    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param poll_interval: seconds between polls.
    :param logged_chars: how much of the job's log the task has already written.
    """

    def __init__(self, submission_id: str, cluster_name: str, namespace: str, raytpu_conn_id: str,
                 poll_interval: float = 2.0, logged_chars: int = 0) -> None:
        super().__init__()
        self.submission_id = submission_id
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.poll_interval = poll_interval
        self.logged_chars = logged_chars

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "submission_id": self.submission_id,
                "cluster_name": self.cluster_name,
                "namespace": self.namespace,
                "raytpu_conn_id": self.raytpu_conn_id,
                "poll_interval": self.poll_interval,
                "logged_chars": self.logged_chars,
            },
        )

    @property
    def hook(self) -> RayJobsHook:
        return RayJobsHook(self.cluster_name, self.namespace, self.raytpu_conn_id)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self.hook
        failures = 0
        while True:
            try:
                status, message = await hook.astatus(self.submission_id)
                logs = await hook.alogs(self.submission_id)
                failures = 0
            except Exception as exc:  # the dashboard restarts, the proxy drops a request
                failures += 1
                if failures > TRANSIENT_FAILURES_ALLOWED:
                    yield TriggerEvent(self._event("ERROR", f"Ray job {self.submission_id} unreachable: {exc}"))
                    return
                self.log.warning("Polling Ray job %s failed (%s); retry %d", self.submission_id, exc, failures)
                await asyncio.sleep(min(self.poll_interval * failures, 30))
                continue
            self._log_new_lines(logs, final=status in TERMINAL)
            if status in TERMINAL:
                yield TriggerEvent(self._event(status, message))
                return
            await asyncio.sleep(self.poll_interval)

    def _log_new_lines(self, logs: str, *, final: bool) -> None:
        new = logs[self.logged_chars:]
        if not final:
            new = new[: new.rfind("\n") + 1]  # hold back a half-written line
        for line in new.splitlines():
            self.log.info("[ray job] %s", line)
        self.logged_chars += len(new)

    def _event(self, status: str, message: str) -> dict[str, Any]:
        return {"status": status, "message": message, "submission_id": self.submission_id,
                "logged_chars": self.logged_chars}

    async def on_kill(self) -> None:
        self.log.info("Task killed: stopping Ray job %s", self.submission_id)
        await self.hook.astop(self.submission_id)
