"""A Ray job's log from an offset, with each character crossing the wire once: Ray's streaming log tail.

Ray's dashboard streams a job's log over a WebSocket (``/api/jobs/{id}/logs/tail``, what
``ray job logs --follow`` uses): the log from its start, then what the driver writes, and it
closes the socket once the job has ended and the log is drained. Through the Kubernetes API
server's service proxy that is one upgraded connection. The stream always starts at the
log's beginning, so after a reconnect (or a triggerer restart) the characters already
consumed are skipped: they cross the wire again once per reconnect, and are never handed out
twice.

Where no WebSocket can be opened (a proxy that does not upgrade connections), the whole log
is read (``GET /api/jobs/{id}/logs``) every tick and cut at the offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.dashboard.job_board import DashboardError
from airflow_provider_raytpu.dashboard.outage import MAX_BACKOFF_SECONDS
from airflow_provider_raytpu.dashboard.transport import TRANSIENT_STATUSES

if TYPE_CHECKING:
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

log = logging.getLogger(__name__)

#: Characters buffered before the follower is woken early (otherwise it takes them each tick).
WAKE_CHARS = 64 * 1024
#: Refused WebSocket upgrades in a row before the log is read whole every tick instead.
UPGRADE_REFUSALS_BEFORE_WHOLE_READS = 3


class LogTail:
    """Follows one job's log from ``offset``; the follower takes the new text with :meth:`take`.

    :param dashboard: the cluster's dashboard transport (looked up again on every reconnect).
    :param submission_id: the job's submission id.
    :param offset: characters of the log already consumed (they are skipped).
    :param wake: set when much text is waiting, and when the tail has ended.
    :param interval: seconds between whole-log reads when no WebSocket can be opened.
    """

    def __init__(self, dashboard: Callable[[], Awaitable[HttpTransport]], submission_id: str, offset: int,
                 wake: asyncio.Event, interval: float) -> None:
        self._dashboard = dashboard
        self.submission_id = submission_id
        self.consumed = offset
        self.wake = wake
        self.interval = interval
        #: Whether the log streams over a WebSocket (else it is read whole every tick).
        self.streaming = True
        #: How often the stream was opened again after it closed early or broke.
        self.reconnects = 0
        #: Characters received, skipped ones included.
        self.received = 0
        self._buffer: list[str] = []
        self._buffered = 0
        self._job_ended = asyncio.Event()
        self._ticked = asyncio.Event()
        self._running_read_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LogTail:
        self._task = asyncio.create_task(self._run(), name=f"raytpu-log-tail-{self.submission_id}")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stop()

    def job_running(self, read_started: float) -> None:
        """The follower read the job's status and it has not ended (once per tick).

        :param read_started: when that read was sent (``time.monotonic()``).
        """
        self._running_read_at = max(self._running_read_at, read_started)
        self._ticked.set()

    def take(self) -> str:
        """The text that arrived since the last call."""
        text = "".join(self._buffer)
        self._buffer, self._buffered = [], 0
        return text

    async def drain(self, timeout: float) -> None:
        """The job has ended: wait for the rest of its log (the stream closes once it is drained);
        after ``timeout`` seconds the rest is read whole instead."""
        self._job_ended.set()
        self._ticked.set()
        assert self._task is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            await self._stop()
            try:
                await self._read_whole()
            except Exception as exc:  # the job's end is known; only its last lines are missing
                log.warning("The end of job %s's log could not be read: %s", self.submission_id, exc)
        except Exception as exc:
            log.warning("The end of job %s's log could not be read: %s", self.submission_id, exc)

    async def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _push(self, text: str) -> None:
        if not text:
            return
        self._buffer.append(text)
        self._buffered += len(text)
        self.consumed += len(text)
        if self._buffered >= WAKE_CHARS:
            self.wake.set()

    async def _run(self) -> None:
        import aiohttp

        refusals = breaks = 0
        while True:
            try:
                closed_by_ray = await self._stream(await self._dashboard())
                refusals = breaks = 0
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status in TRANSIENT_STATUSES:  # unreachable for now (the job's follower says so)
                    breaks += 1
                    await asyncio.sleep(min(MAX_BACKOFF_SECONDS, self.interval * breaks))
                    continue
                refusals += 1
                if refusals >= UPGRADE_REFUSALS_BEFORE_WHOLE_READS:
                    log.warning("Ray's log stream of job %s cannot be opened (%s %s); reading the whole log every "
                                "%s s instead", self.submission_id, exc.status, exc.message, self.interval)
                    self.streaming = False
                    await self._read_whole_every_tick()
                    return
                await asyncio.sleep(self.interval)
                continue
            except Exception as exc:  # the head restarting, the proxy dropping the stream
                breaks += 1
                log.log(logging.INFO if breaks == 1 else logging.DEBUG,
                        "Ray's log stream of job %s broke (%s); opening it again", self.submission_id,
                        str(exc) or type(exc).__name__)
                self.reconnects += 1
                await asyncio.sleep(min(MAX_BACKOFF_SECONDS, min(self.interval, 1.0) * breaks))
                continue
            # Ray closes the stream with a close frame once the job has ended and its log is drained.
            # Any other end (a close before the job ended: a proxy's timeout; a connection dropped
            # without a close frame: an API server or head restarting) may leave text unread, so the
            # stream is opened again, once the follower has read the job's status if it is still running.
            if not self._job_ended.is_set():
                await self._status_read_after(time.monotonic())
            if closed_by_ray and self._job_ended.is_set():
                self.wake.set()
                return
            self.reconnects += 1

    async def _status_read_after(self, closed_at: float) -> None:
        """Wait until the follower has read the job's status with a read sent after ``closed_at`` (a read sent
        before the close may answer "running" after it: seen under load), or it ended; at most
        ``max(10, 3 * interval)`` seconds."""
        deadline = closed_at + max(10.0, 3 * self.interval)
        while not self._job_ended.is_set() and self._running_read_at < closed_at:
            self._ticked.clear()
            try:
                await asyncio.wait_for(self._ticked.wait(), deadline - time.monotonic())
            except TimeoutError:
                return

    async def _stream(self, transport: HttpTransport) -> bool:
        """Pass on the stream's text until it ends; whether it ended with a close frame (aiohttp reports a
        dropped connection as closed too, without one)."""
        import aiohttp

        async with transport.websocket(f"/api/jobs/{self.submission_id}/logs/tail") as ws:
            skip = self.consumed
            while True:
                message = await ws.receive()
                if message.type is not aiohttp.WSMsgType.TEXT:
                    return message.type is aiohttp.WSMsgType.CLOSE
                text: str = message.data
                self.received += len(text)
                if skip:
                    cut = min(skip, len(text))
                    text, skip = text[cut:], skip - cut
                self._push(text)

    async def _read_whole_every_tick(self) -> None:
        while True:
            ended = self._job_ended.is_set()
            try:
                await self._read_whole()
            except Exception as exc:  # the job's own follower gives up on its own failures
                if ended:
                    raise
                log.info("Reading the log of job %s failed (%s); trying again", self.submission_id, exc)
            if ended:
                self.wake.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._job_ended.wait(), self.interval)

    async def _read_whole(self) -> None:
        transport = await self._dashboard()
        answer = await transport.arequest("GET", f"/api/jobs/{self.submission_id}/logs",
                                          headers={"Accept": "application/json"})
        if not answer.ok:
            raise DashboardError(f"GET /api/jobs/{self.submission_id}/logs answered {answer.status}: "
                                 f"{answer.text(500)}")
        text: str = answer.json()["logs"]
        self.received += len(text)
        self._push(text[self.consumed:])
