"""Follow a Ray job from the triggerer: write each line of its log once, fire when it ends."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from airflow_provider_raytpu.hooks.job_log import JobLogFollower
from airflow_provider_raytpu.hooks.ray_jobs import TERMINAL, RayJobsHook
from airflow_provider_raytpu.progress import Heartbeat
from airflow_provider_raytpu.workloads.result import RESULT_PREFIX, last_result

TRANSIENT_FAILURES_ALLOWED = 10
#: How long a job's log may take to arrive in full once the job has ended.
DRAIN_SECONDS = 30.0
#: How often, at most, the position in the log is saved while lines are written (lines that
#: arrive sooner wait for the next save: a line reaches the task log at most this late).
OFFSET_SAVE_SECONDS = 5.0
#: The XCom that keeps how much of the job's log the task's log already has.
LOG_OFFSET_KEY = "raytpu_job_log_offset"
LOG_TAIL_LINES = 50
#: Failed saves in a row after which held lines are written anyway (a restart may repeat them).
SAVE_FAILURES_BEFORE_WRITING = 3


class RayJobTrigger(BaseTrigger):
    """Follow one Ray job: write each line of its log to the task log once, as it appears (without
    terminal colour codes or progress-bar redraws, and a progress line while it is quiet); fire on
    SUCCEEDED, FAILED or STOPPED.

    The job's status comes from its cluster's job list, read once per tick for every job
    trigger on that cluster; its log from Ray's streaming log tail
    (:class:`~airflow_provider_raytpu.hooks.log_tail.LogTail`). How much of the log was written
    is saved in the task's XCom ``raytpu_job_log_offset`` before the lines up to it are written
    (at most every 5 s: lines that arrive sooner wait), so a trigger that a restarted triggerer
    runs again goes on from there and writes each line once. The event carries the job's
    result, and a job that did not succeed its last 50 lines, so the task need not download
    the log.

    Killing the task (mark failed, clear) stops the Ray job through :meth:`on_kill`.

    :param submission_id: the Ray job's submission id.
    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param poll_interval: seconds between reads of the job's status.
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
        self._unwritten = ""
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._result_line: str | None = None
        self._shown = JobLogFollower()
        self._heartbeat = Heartbeat()
        self._saved_at = -OFFSET_SAVE_SECONDS
        self._failed_saves = 0

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
        self.logged_chars = max(self.logged_chars, await self._saved_offset())
        from_start = self.logged_chars == 0
        try:
            event = await self._follow(hook)
        except Exception as exc:  # no connection, no dashboard: the task fails with the reason
            event = self._event("ERROR", f"Ray job {self.submission_id} unreachable: {exc}")
        if event["status"] in TERMINAL:
            if event["status"] != "SUCCEEDED":  # for the task's error; Airflow logs the whole event, so
                event["log_tail"] = "\n".join(self._tail)  # a success's tail would repeat lines in the log
            if from_start or self._result_line is not None:
                event["result"] = last_result(self._result_line or "")
        # Everything is closed before the event goes out: a consumer that takes only the first
        # event and never resumes this generator (``dag.test()``) leaves nothing open behind.
        yield TriggerEvent(event)

    async def _follow(self, hook: RayJobsHook) -> dict[str, Any]:
        wake = asyncio.Event()
        failures = reads = 0
        board = await hook.ajob_board()
        async with board.follow(self.submission_id, self.poll_interval, wake) as job, \
                hook.log_tail(self.submission_id, self.logged_chars, wake, self.poll_interval) as tail:
            heartbeat = self._heartbeat
            while True:
                try:
                    await asyncio.wait_for(wake.wait(), min(heartbeat.seconds_left(), self._save_due_in()))
                except TimeoutError:  # quiet, or lines held back until the next save
                    await self._pass_on("")
                    if heartbeat.due():
                        status = job.job["status"] if job.job is not None else "status not read yet"
                        self.log.info("Waiting for Ray job %s: %s, no new output (%.0f s)", self.submission_id,
                                      status, heartbeat.elapsed)
                    continue
                wake.clear()
                await self._pass_on(tail.take())
                if job.reads == reads:
                    continue
                reads = job.reads
                if job.error is not None or job.job is None:
                    failures += 1
                    problem = job.error or f"the cluster's dashboard does not list job {self.submission_id}"
                    if failures > TRANSIENT_FAILURES_ALLOWED:
                        return self._event("ERROR", f"Ray job {self.submission_id} unreachable: {problem}")
                    self.log.warning("Reading Ray job %s failed (%s); retry %d", self.submission_id, problem, failures)
                    continue
                failures = 0
                if job.job["status"] not in TERMINAL:
                    tail.job_running()
                else:
                    await tail.drain(DRAIN_SECONDS)
                    await self._pass_on(tail.take(), final=True)
                    return self._event(job.job["status"], job.job.get("message") or "")

    async def _pass_on(self, text: str, *, final: bool = False) -> None:
        """Take ``text`` after what was read and not yet written; when a save is due (or the log is
        complete), save the position after its complete lines, then write them."""
        self._unwritten += text
        if not final and self._save_due_in() > 0:
            return
        lines = self._unwritten.split("\n")
        partial = "" if final else lines.pop()  # when final, the log's last line may lack a newline
        if final and lines[-1] == "":
            lines.pop()
        chars = len(self._unwritten) - len(partial)
        if chars == 0:
            return
        saving = asyncio.ensure_future(self._save_offset(self.logged_chars + chars))
        try:
            saved = await asyncio.shield(saving)
        except asyncio.CancelledError:
            # The triggerer stops mid-save (its connection to the supervisor closes before its triggers
            # are cancelled): the lines are written only if the save landed, else the next trigger does.
            if saving.done() and not saving.cancelled() and saving.result():
                self._write(lines, chars)
            raise
        if not (saved or final or self._failed_saves >= SAVE_FAILURES_BEFORE_WRITING):
            return  # held until the next save: a stopping triggerer's saves fail, its lines wait for the next
        self._unwritten = partial
        self._write(lines, chars)

    def _save_due_in(self) -> float:
        """Seconds until lines held back may be saved and written (0: now; inf: none held)."""
        if "\n" not in self._unwritten:
            return float("inf")
        if self._xcom_target() is None:
            return 0.0
        return max(0.0, self._saved_at + OFFSET_SAVE_SECONDS - time.monotonic())

    def _write(self, lines: list[str], chars: int) -> None:
        """Write ``lines``, the next ``chars`` characters of the job's log, to the task log."""
        for line in lines:
            line = line.rstrip("\r")
            self._tail.append(line)
            if RESULT_PREFIX in line and last_result(line) is not None:
                self._result_line = line
        for line in self._shown.shown("\n".join(lines)):
            self.log.info("[ray job] %s", line)
            self._heartbeat.quiet()
        self.logged_chars += chars

    def _event(self, status: str, message: str) -> dict[str, Any]:
        return {"status": status, "message": message, "submission_id": self.submission_id,
                "logged_chars": self.logged_chars}

    # -- the position in the log, kept in the task's XCom -----------------------------------------------

    def _xcom_target(self) -> dict[str, Any] | None:
        ti = self.task_instance
        if ti is None:
            return None
        map_index = getattr(ti, "map_index", None)
        return {"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
                "map_index": -1 if map_index is None else map_index}

    async def _saved_offset(self) -> int:
        target = self._xcom_target()
        if target is None:
            return 0
        from airflow.sdk.execution_time.xcom import XCom

        try:
            saved = await asyncio.to_thread(XCom.get_one, key=LOG_OFFSET_KEY, **target)
        except Exception as exc:  # no position: the log is written from the offset the task deferred with
            self.log.warning("Could not read how much of Ray job %s's log was written: %s", self.submission_id, exc)
            return 0
        if isinstance(saved, dict) and saved.get("submission_id") == self.submission_id:
            self.log.info("Continuing Ray job %s's log after the %d characters already written",
                          self.submission_id, saved["logged_chars"])
            return int(saved["logged_chars"])
        return 0

    async def _save_offset(self, logged_chars: int) -> bool:
        """Save that the task log has the job's log up to ``logged_chars``; whether it was saved."""
        target = self._xcom_target()
        if target is None:
            return True
        from airflow.sdk.execution_time.xcom import XCom

        self._saved_at = time.monotonic()
        value = {"submission_id": self.submission_id, "logged_chars": logged_chars}
        try:
            await asyncio.to_thread(XCom.set, LOG_OFFSET_KEY, value, **target)
        except Exception as exc:
            self._failed_saves += 1
            self.log.warning("Could not save how much of Ray job %s's log was written (%d in a row): %s",
                             self.submission_id, self._failed_saves, exc)
            return False
        self._failed_saves = 0
        return True

    async def on_kill(self) -> None:
        self.log.info("Task killed: stopping Ray job %s", self.submission_id)
        await self.hook.astop(self.submission_id)
