"""Follow a Ray job from the triggerer: write each line of its log once, fire when it ends."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_raytpu.dashboard.job_log import JobLogFollower, job_error, job_message, shown_tail
from airflow_provider_raytpu.dashboard.outage import DEFAULT_UNREACHABLE_GRACE, Outage
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.ray_jobs import TERMINAL, RayJobsHook
from airflow_provider_raytpu.progress import LogPace
from airflow_provider_raytpu.workloads.result import RESULT_PREFIX, last_result

#: Seconds a reachable dashboard may not list the job before the trigger gives up (a restarted head
#: forgets its jobs; the task's retry submits again).
UNLISTED_GRACE = 60.0
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


def seal_secrets(secrets: list[str]) -> str | None:
    """``secrets`` encrypted with Airflow's Fernet key (``[core] fernet_key``, which the worker and the
    triggerer share), for a trigger's arguments: Airflow 3 stores those as the task sends them, in plain JSON.
    Without a key, Airflow's own rule: stored as they are, with Airflow's warning."""
    if not secrets:
        return None
    from airflow.sdk.crypto import get_fernet

    try:
        fernet = get_fernet()
    except Exception as exc:  # a key that is not one: Airflow raises, naming no setting
        raise FatalError(
            f"Airflow's [core] fernet_key cannot seal the task's secrets for the triggerer ({exc}). Set it to a "
            "key from: python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())' "
            "(the same on workers and triggerers), or run the task without deferring (deferrable=False)") from exc
    return fernet.encrypt(json.dumps(secrets).encode()).decode()


def unseal_secrets(sealed: str | None) -> list[str]:
    """What :func:`seal_secrets` sealed."""
    if not sealed:
        return []
    from airflow.sdk.crypto import get_fernet

    found: list[str] = json.loads(get_fernet().decrypt(sealed.encode()))
    return found


class RayJobTrigger(BaseTrigger):
    """Follow one Ray job: write each line of its log to the task log once, as it appears (without
    terminal colour codes or progress-bar redraws, and a progress line while it is quiet); fire on
    SUCCEEDED, FAILED or STOPPED.

    The job's status comes from its cluster's job list, read once per tick for every job
    trigger on that cluster; its log from Ray's streaming log tail
    (:class:`~airflow_provider_raytpu.dashboard.log_tail.LogTail`). How much of the log was written
    is saved in the task's XCom ``raytpu_job_log_offset`` before the lines up to it are written
    (at most every 5 s: lines that arrive sooner wait), and confirmed once they were, so a trigger
    that a restarted triggerer runs again goes on from there and writes each line once. Lines whose
    write a killed triggerer may not have finished (saved, not confirmed) are written again, marked
    ``[ray job, again]``: they may repeat, never go missing. The event carries the job's
    result, and a job that did not succeed its last 50 lines, so the task need not download
    the log.

    While the cluster's dashboard (or the API server proxying it) is unreachable, the job is
    followed on for ``unreachable_grace_period`` seconds, with a line at least every 10 s saying what
    is unreachable; after that the trigger fires ``ERROR`` and the task decides (it may retry).

    Killing the task (mark failed, clear) stops the Ray job through :meth:`on_kill`.

    :param submission_id: the Ray job's submission id.
    :param cluster_name: the RayCluster's name.
    :param namespace: its namespace.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param poll_interval: seconds between reads of the job's status.
    :param logged_chars: how much of the job's log the task has already written.
    :param unreachable_grace_period: seconds the job's status may be unreadable before the trigger gives up.
    :param sealed_secrets: the task's secret values, sealed by :func:`seal_secrets` (Airflow stores a trigger's
        arguments as they are given): registered with the triggerer's masker, so the job's lines, the event and
        its log tail show them as ``***``.
    """

    def __init__(self, submission_id: str, cluster_name: str, namespace: str, raytpu_conn_id: str,
                 poll_interval: float = 2.0, logged_chars: int = 0,
                 unreachable_grace_period: float = DEFAULT_UNREACHABLE_GRACE,
                 sealed_secrets: str | None = None) -> None:
        super().__init__()
        self.submission_id = submission_id
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.poll_interval = poll_interval
        self.logged_chars = logged_chars
        self.unreachable_grace_period = unreachable_grace_period
        self.sealed_secrets = sealed_secrets
        self.secrets: list[str] = []
        self._unwritten = ""
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._result_line: str | None = None
        self._shown = JobLogFollower()
        self._pace = LogPace()
        self._saved_at = -OFFSET_SAVE_SECONDS
        self._again_until = 0
        self._failed_saves = 0
        self._failed_read: tuple[str, object] = ("", "")

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
                "unreachable_grace_period": self.unreachable_grace_period,
                "sealed_secrets": self.sealed_secrets,
            },
        )

    def __repr__(self) -> str:
        classpath, kwargs = self.serialize()
        return str(self.repr(classpath, {**kwargs, "sealed_secrets": "<sealed>" if self.sealed_secrets else None}))

    @property
    def hook(self) -> RayJobsHook:
        return RayJobsHook(self.cluster_name, self.namespace, self.raytpu_conn_id)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow.sdk.log import amask_secret

        try:
            self.secrets = unseal_secrets(self.sealed_secrets)
        except Exception as exc:  # never follow the job unmasked
            yield TriggerEvent(self._event("ERROR", (
                f"Ray job {self.submission_id}: this triggerer cannot unseal the task's secrets ({type(exc).__name__}"
                "): its [core] fernet_key is not the workers'. Set the same key on workers and triggerers")))
            return
        for secret in self.secrets:  # this process (a triggerer, perhaps a restarted one) knew none of them
            await amask_secret(secret)
        hook = self.hook
        self.logged_chars = max(self.logged_chars, await self._saved_offset())
        from_start = self.logged_chars == 0
        try:
            event = await self._follow(hook)
        except Exception as exc:  # no connection, no dashboard: the task fails with the reason
            event = self._event("ERROR", f"Ray job {self.submission_id} unreachable: {exc}")
        if event["status"] in TERMINAL:
            if event["status"] != "SUCCEEDED":  # for the task's error. Airflow logs the whole event, so it
                tail = "\n".join(self._tail)  # carries the driver's exception, or the tail when it ended without
                error = job_error(tail)
                event.update({"error": dataclasses.asdict(error)} if error else {"log_tail": tail})
            if from_start or self._result_line is not None:
                event["result"] = last_result(self._result_line or "")
        # The event is stored and logged outside this process's masker: what it says is masked here.
        event = {key: self._masked(value) if key in ("message", "log_tail") else value for key, value in event.items()}
        if "error" in event:
            event["error"] = {key: self._masked(value) for key, value in event["error"].items()}
        # Everything is closed before the event goes out: a consumer that takes only the first
        # event and never resumes this generator (``dag.test()``) leaves nothing open behind.
        yield TriggerEvent(event)

    async def _follow(self, hook: RayJobsHook) -> dict[str, Any]:
        wake = asyncio.Event()
        reads = 0
        unreachable = Outage(self.unreachable_grace_period)
        unlisted = Outage(min(self.unreachable_grace_period, UNLISTED_GRACE))
        where = f"the dashboard of RayCluster {self.namespace}/{self.cluster_name}"
        board = await hook.ajob_board()
        async with board.follow(self.submission_id, self.poll_interval, wake) as job, \
                hook.log_tail(self.submission_id, self.logged_chars, wake, self.poll_interval) as tail:
            pace = self._pace
            while True:
                try:
                    await asyncio.wait_for(wake.wait(), min(pace.seconds_left(), self._save_due_in()))
                except TimeoutError:  # quiet, or lines held back until the next save
                    await self._pass_on("")
                    if pace.due():
                        self.log.info("%s", self._quiet_line(job.job, unreachable, unlisted))
                    continue
                wake.clear()
                await self._pass_on(tail.take())
                if job.reads == reads:
                    continue
                reads = job.reads
                if job.error is not None or job.job is None:
                    # Unreachable (an error) for up to the grace; reachable without the job, briefly
                    # (a restarted head forgets its jobs: the task's retry submits again).
                    outage, what = (unreachable, f"{where} unreachable") if job.error is not None else (
                        unlisted, f"{where} without the job")
                    problem = job.error or f"GET /api/jobs/ does not list {self.submission_id}"
                    if (gave_up := self._read_failed(outage, what, problem)) is not None:
                        return gave_up
                    continue
                unlisted.recovered()
                if (lasted := unreachable.recovered()) is not None:
                    self.log.info("Ray job %s: %s answers again after %.0f s", self.submission_id, where, lasted)
                entry = job.job  # the next read may fail or miss the job while the log drains
                if entry["status"] not in TERMINAL:
                    tail.job_running(job.read_started)
                else:
                    await tail.drain(DRAIN_SECONDS)
                    await self._pass_on(tail.take(), final=True)
                    return self._event(entry["status"], job_message(entry.get("message")))

    def _read_failed(self, outage: Outage, what: str, problem: object) -> dict[str, Any] | None:
        """One more failed read of the job's status: the ``ERROR`` event once ``outage`` is over its grace,
        else ``None`` after a warning (the first) or a progress line (at least every 8 s)."""
        outage.failed()
        if outage.over_grace:
            return self._event("ERROR", f"Ray job {self.submission_id}: {outage.given_up(what, problem)}")
        self._failed_read = (what, problem)
        if outage.failures == 1:
            self._pace.quiet()
            self.log.warning("Ray job %s: %s", self.submission_id, outage.describe(what, problem))
        elif self._pace.due():
            self.log.info("%s", self._quiet_line(None, outage))
        return None

    def _quiet_line(self, job: dict[str, Any] | None, *outages: Outage) -> str:
        """What the log says while the job is quiet: the outage going on (what, for how long, why), or the job's
        status."""
        if (outage := next((o for o in outages if o.since is not None), None)) is not None:
            return f"Ray job {self.submission_id}: {outage.describe(*self._failed_read)}"
        status = job["status"] if job is not None else "status not read yet"
        return f"Waiting for Ray job {self.submission_id}: {status}, no new output ({self._pace.elapsed:.0f} s)"

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
        saving = asyncio.ensure_future(self._save_offset(self.logged_chars + chars, confirmed=self.logged_chars))
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
        if saved:
            # The triggerer's supervisor serves its log and request sockets in one loop: lines sent before
            # this request are in the log file once it is answered. A killed supervisor drops lines it had
            # not read yet, so a save not confirmed this way marks its lines as perhaps unwritten.
            await asyncio.shield(self._save_offset(self.logged_chars, confirmed=self.logged_chars))

    def _save_due_in(self) -> float:
        """Seconds until lines held back may be saved and written (0: now; inf: none held)."""
        if "\n" not in self._unwritten:
            return float("inf")
        if self._xcom_target() is None:
            return 0.0
        return max(0.0, self._saved_at + OFFSET_SAVE_SECONDS - time.monotonic())

    def _write(self, lines: list[str], chars: int) -> None:
        """Write ``lines``, the next ``chars`` characters of the job's log, to the task log."""
        again, position = 0, self.logged_chars  # lines up to where an earlier trigger's unconfirmed write ended
        while again < len(lines) and position < self._again_until:
            position += len(lines[again]) + 1
            again += 1
        for line in lines:
            line = line.rstrip("\r")
            self._tail.extend(shown_tail(line, 1).splitlines())
            if RESULT_PREFIX in line and last_result(line) is not None:
                self._result_line = line
        for mark, part in (("[ray job, again]", lines[:again]), ("[ray job]", lines[again:])):
            for line in self._shown.shown("\n".join(part)) if part else ():
                self.log.info("%s %s", mark, self._masked(line))
                self._pace.quiet()
        self.logged_chars += chars

    def _masked(self, text: str) -> str:
        """``text`` through the masker (which run() taught the task's secrets), whatever the logging set-up."""
        if not self.secrets:
            return text
        from airflow_provider_raytpu.compat import redact

        return str(redact(text))

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
        if not (isinstance(saved, dict) and saved.get("submission_id") == self.submission_id):
            return 0
        record: dict[str, Any] = saved
        logged, confirmed = int(record["logged_chars"]), int(record.get("confirmed_chars", record["logged_chars"]))
        if confirmed < logged:
            self._again_until = logged
            self.log.warning("The triggerer that followed Ray job %s stopped while writing the %d characters of its "
                             "log after the first %d: they may be above already and are written again below, "
                             'marked "[ray job, again]"', self.submission_id, logged - confirmed, confirmed)
        else:
            self.log.info("Continuing Ray job %s's log after the %d characters already written",
                          self.submission_id, confirmed)
        return confirmed

    async def _save_offset(self, logged_chars: int, *, confirmed: int) -> bool:
        """Save that the task log has the job's log up to ``logged_chars``, certainly up to ``confirmed``
        (the lines between are being written); whether it was saved."""
        target = self._xcom_target()
        if target is None:
            return True
        from airflow.sdk.execution_time.xcom import XCom

        self._saved_at = time.monotonic()
        value = {"submission_id": self.submission_id, "logged_chars": logged_chars, "confirmed_chars": confirmed}
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
