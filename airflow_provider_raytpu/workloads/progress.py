"""How far each attempt of a training run got, so the steps a restart lost can be counted afterwards.

An attempt is one start of the train loop's workers: the first of a run, a worker group Ray Train
restarted after a failure (a preempted slice), or an Airflow retry resuming the run. Rank 0's
:class:`~airflow_provider_raytpu.workloads.steps.StepClock` records its attempt in the run's storage,
``<run>/attempts/attempt-<start ns>.json``: ``{"started_at", "first_step", "reached"}``, where
``first_step`` is the step it started at (the checkpoint it resumed from, 0 when fresh) and
``reached`` the steps done when last recorded. It is recorded at the first step, then by a background
thread every :data:`PROGRESS_EVERY_S` seconds while it changes, and at the clock's ``close``: a host
that dies mid-run leaves a record at most that old, and the loop never waits for storage. (GCS takes
one write per second to an object; 2 s of writes cost about 1 cent per TPU-slice-day.)

:func:`training_progress` turns the records into what a restart cost: an attempt reached step 17,
the next resumed from the checkpoint at 10, so 7 steps were lost (at least: steps done in the last
seconds before a failure may not be recorded). The training task reads them after its job
(``JaxTrainerOperator``), so imports here are the standard library's only.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)
ATTEMPTS_SUBDIR = "attempts"
ATTEMPT_PREFIX = "attempt-"
PROGRESS_EVERY_S = 2.0


class AttemptProgress:
    """Records one attempt's first step and the steps it reached into ``<attempts_uri>/attempt-<start ns>.json``.

    :param attempts_uri: the run's ``attempts`` directory.
    :param every_s: at most how often the record is rewritten while the loop runs.
    """

    def __init__(self, attempts_uri: str, every_s: float = PROGRESS_EVERY_S) -> None:
        from airflow_provider_raytpu.workloads.storage import resolve

        started_ns = time.time_ns()
        self.location = resolve(attempts_uri).child(f"{ATTEMPT_PREFIX}{started_ns}.json")
        self.started_at = started_ns / 1e9
        self.every_s = every_s
        self.first_step: int | None = None
        self.reached: int | None = None
        self._written: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stepped(self, number: int) -> None:
        """Step ``number`` is done (the first step of a fresh run is 0): ``number + 1`` steps are reached."""
        if self.first_step is None:
            self.first_step = number
            self.reached = number + 1
            self._try_write()
            self._thread = threading.Thread(target=self._keep_writing, name="raytpu-attempt-progress", daemon=True)
            self._thread.start()
        self.reached = number + 1

    def write(self) -> None:
        """Record the attempt now, unless the record already says as much."""
        reached = self.reached
        if self.first_step is None or reached == self._written:
            return
        from airflow_provider_raytpu.workloads.storage import write_file

        record = {"started_at": self.started_at, "first_step": self.first_step, "reached": reached}
        write_file(self.location, json.dumps(record, sort_keys=True).encode())
        self._written = reached

    def close(self) -> None:
        """Stop the background writes and record the attempt a last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._try_write()

    def _keep_writing(self) -> None:
        while not self._stop.wait(self.every_s):
            self._try_write()

    def _try_write(self) -> None:
        """Write, and only warn when storage fails: a figure never stops the training."""
        try:
            self.write()
        except Exception as exc:  # storage briefly unreachable: the next write catches up
            log.warning("could not record the attempt's progress in %s: %s", self.location.uri, exc)


def training_progress(records: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """What the run's restarts cost, from its attempts' records (``None`` without any).

    ``attempts`` counts the starts, ``restarts`` the starts after the first, ``steps_lost`` the steps
    each attempt reached beyond the step the next one started at, summed (an attempt that started
    before the checkpoint the next one resumed from wrote it, so reached at least that far), ``started_at_step`` the
    first attempt's first step, and ``lost`` lists each restart's ``{"reached", "resumed_from",
    "steps_lost"}`` in order.

    :param records: the decoded ``attempts/attempt-*.json`` files of one run, in any order.
    """
    attempts = sorted(records, key=lambda r: float(r["started_at"]))
    if not attempts:
        return None
    lost = []
    for before, after in itertools.pairwise(attempts):
        reached, resumed = int(before["reached"]), int(after["first_step"])
        if resumed > int(before["first_step"]):
            reached = max(reached, resumed)  # it wrote that checkpoint: its record was older
        lost.append({"reached": reached, "resumed_from": resumed, "steps_lost": max(0, reached - resumed)})
    return {"attempts": len(attempts), "restarts": len(lost), "steps_lost": sum(r["steps_lost"] for r in lost),
            "started_at_step": int(attempts[0]["first_step"]), "lost": lost}
