"""Following a Ray job through a dashboard or API-server outage: a blip is not a failure.

A head restarting, a proxy redeploying or an API server upgrade makes the Jobs API answer
502/503/504 or not at all for a while; the job itself runs on. A task that follows the job
keeps trying for a grace period (:data:`DEFAULT_UNREACHABLE_GRACE`, the same 10 minutes a
KubeRay reconcile failure gets), says what is unreachable at least every 10 s, and only then
gives up, leaving the decision to retry to Airflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from airflow_provider_raytpu.dashboard.transport import TRANSIENT_STATUSES, DashboardUnavailableError
from airflow_provider_raytpu.progress import LogPace, TaskLog

T = TypeVar("T")

#: Seconds a job's dashboard may be unreachable before the task following the job gives up.
DEFAULT_UNREACHABLE_GRACE = 600.0
#: The longest pause between two tries while unreachable.
MAX_BACKOFF_SECONDS = 5.0


class DashboardUnreachableError(Exception):
    """The dashboard stayed unreachable for longer than the grace period."""


def problem_of(error: BaseException) -> str:
    """What went wrong, for a log line: the error's text, or its type when it has none (a ``TimeoutError()``)."""
    return str(error) or type(error).__name__


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` says an endpoint (the dashboard, the API server) is unreachable for now, not that
    the request is wrong: refused, reset, timed out, no route, or an answer of 429 or 5xx."""
    if isinstance(error, (DashboardUnavailableError, OSError)):  # TimeoutError and ConnectionError too
        return True
    status = getattr(error, "status", None)  # the Kubernetes clients' ApiException
    if isinstance(status, int) and (status in TRANSIENT_STATUSES or status >= 500):
        return True
    import aiohttp
    from urllib3.exceptions import HTTPError

    return isinstance(error, (HTTPError, aiohttp.ClientError))


class Outage:
    """How long an endpoint has been unreachable, and whether that is longer than its grace.

    :param grace: seconds it may be unreachable.
    :param clock: the clock (``time.monotonic``).
    """

    def __init__(self, grace: float = DEFAULT_UNREACHABLE_GRACE, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self.clock = clock
        self.since: float | None = None
        self.failures = 0

    @property
    def lasted(self) -> float:
        """Seconds since the first failure of this outage (0 when reachable)."""
        return 0.0 if self.since is None else self.clock() - self.since

    @property
    def over_grace(self) -> bool:
        return self.since is not None and self.lasted > self.grace

    def failed(self) -> None:
        """One more try failed."""
        if self.since is None:
            self.since = self.clock()
        self.failures += 1

    def recovered(self) -> float | None:
        """A try succeeded: how long the outage lasted (``None`` when there was none)."""
        lasted = None if self.since is None else self.lasted
        self.since, self.failures = None, 0
        return lasted

    def backoff(self) -> float:
        """Seconds to wait before the next try: 0.5, 1, 2, ... up to :data:`MAX_BACKOFF_SECONDS`."""
        return min(MAX_BACKOFF_SECONDS, 0.5 * 2.0 ** max(0, self.failures - 1))

    def describe(self, what: str, problem: object) -> str:
        """``"<what> for 12 s (<problem>); trying for up to 588 s more"``, ``what`` e.g.
        ``"the dashboard unreachable"``."""
        left = max(0.0, self.grace - self.lasted)
        return f"{what} for {self.lasted:.0f} s ({problem}); trying for up to {left:.0f} s more"

    def given_up(self, what: str, problem: object) -> str:
        """``"<what> for 601 s, longer than its grace of 600 s: <problem>"``."""
        return f"{what} for {self.lasted:.0f} s, longer than its grace of {self.grace:.0f} s: {problem}"


def call_through_outage(call: Callable[[], T], what: str, grace: float, log: TaskLog,
                        sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, tried again while it fails transiently (:func:`is_transient`), for up to ``grace`` seconds.

    The first failure is a warning; then a line at least every 8 s says what is unreachable and
    for how long; a success after failures says how long the outage lasted.

    :param call: one request (or a few) to the dashboard.
    :param what: what is reached, for the lines, e.g. ``"the dashboard of RayCluster ml/train"``.
    :param grace: seconds to keep trying.
    :param log: where the lines go (the task's logger).
    :raises DashboardUnreachableError: still failing after ``grace`` seconds (from the last error).
    """
    outage = Outage(grace)
    pace = LogPace()
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            outage.failed()
            if outage.over_grace:
                raise DashboardUnreachableError(outage.given_up(f"{what} unreachable", problem_of(exc))) from exc
            line = outage.describe(f"{what} unreachable", problem_of(exc))
            if outage.failures == 1:
                pace.quiet()
                log.warning("%s", line)
            elif pace.due():
                log.info("%s", line)
            sleep(min(outage.backoff(), pace.seconds_left(), max(0.0, grace - outage.lasted) + 0.01))
            continue
        if (lasted := outage.recovered()) is not None:
            log.info("%s answers again after %.0f s", what[:1].upper() + what[1:], lasted)
        return result
