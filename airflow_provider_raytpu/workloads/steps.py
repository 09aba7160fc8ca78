"""Step times and JAX profiler traces, taken from inside a train loop.

A train loop times its steps with a :class:`StepClock`; the training job gives the clock
its window of steps to profile (``JaxTrainerOperator(profile_steps=(100, 105))``) through
the loop's config::

    clock = StepClock(config)
    while step < total_steps:
        with clock.step(step):
            with clock.data():
                batch = next_batch(step)             # time spent waiting for data
            state, loss = train_step(state, batch)
            loss = float(loss)                       # wait for the device: JAX dispatches asynchronously
        step += 1
    clock.close()

While the window runs, every worker records a JAX profiler trace (``jax.profiler``, with
a ``StepTraceAnnotation`` per step) and, when the window ends, copies it into the run's
storage in TensorBoard's profile layout: ``<run>/profile/plugins/profile/steps-<first>-<end>/
worker-<rank>.xplane.pb``, one file per worker, so TensorBoard (``--logdir <run>/profile``)
shows every host of the step window side by side. At :meth:`StepClock.close` each worker
writes a summary of its step times to ``<run>/steps/worker-<rank>.json``; the training job
reads them into its result (``step_time``) and the task log's last line. Rank 0's clock also
records how far this attempt of the run got in ``<run>/attempts/``
(:mod:`~airflow_provider_raytpu.workloads.progress`): the training task counts the steps a
restart lost from those records.

The first step a worker times is left out of the median and p95 (it includes JAX's
compilation) and reported on its own.

Importing this module imports neither JAX, Ray nor pyarrow (the operator checks
``profile_steps`` with :func:`profile_window`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.workloads.progress import ATTEMPTS_SUBDIR, AttemptProgress

PROFILE_SUBDIR = "profile"
STEPS_SUBDIR = "steps"
TRACE_PLUGIN_DIR = "plugins/profile"
TRACE_SUFFIXES = (".xplane.pb", ".trace.json.gz", ".memory_profile.json.gz")


def profile_window(value: Any) -> tuple[int, int] | None:
    """``profile_steps`` as ``(first, end)``: the steps ``first <= step < end`` are traced.

    :param value: ``None``, or a pair of step numbers such as ``(100, 105)`` or ``[100, 105]``.
    :raises InvalidInputError: for anything else (a ``ValueError``), naming the value and the fix.
    """
    if value is None:
        return None
    fix = "Write a pair (first, end), e.g. (100, 105) traces steps 100 to 104"
    try:
        first, end = (int(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidInputError("profile_steps", value, "is not a pair of step numbers", fix) from None
    if first < 0 or end <= first:
        raise InvalidInputError("profile_steps", value,
                                "is not a window of steps: the first is below 0 or the end not after it", fix)
    return first, end


def percentile(sorted_values: list[float], share: float) -> float:
    """The nearest-rank percentile of already sorted values.

    :param sorted_values: at least one value, ascending.
    :param share: e.g. 0.95.
    """
    index = max(0, math.ceil(share * len(sorted_values)) - 1)
    return sorted_values[index]


class StepClock:
    """Times a train loop's steps and the data waits inside them; traces a window of steps with ``jax.profiler``.

    :param config: the loop's config; ``profile_steps`` and ``profile_uri`` (set by the
        training job) choose the window and where traces go.
    :param rank: this worker's rank; default: Ray Train's world rank, or 0 outside Ray Train.
    :param steps_uri: where :meth:`close` writes this worker's summary; default: the run's
        ``steps`` directory inside Ray Train, nowhere outside it.
    :param attempts_uri: where rank 0 records how far this attempt got; default: the run's
        ``attempts`` directory inside Ray Train, nowhere outside it.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, *, rank: int | None = None,
                 steps_uri: str | None = None, attempts_uri: str | None = None) -> None:
        config = config or {}
        self.window = profile_window(config.get("profile_steps"))
        self.profile_uri: str | None = config.get("profile_uri")
        from airflow_provider_raytpu.workloads.checkpoints import in_train_worker, run_uri

        in_ray_train = in_train_worker()
        if rank is None:
            import ray.train

            rank = ray.train.get_context().get_world_rank() if in_ray_train else 0
        self.rank = rank
        if in_ray_train:
            steps_uri = steps_uri or f"{run_uri()}/{STEPS_SUBDIR}"
            attempts_uri = attempts_uri or f"{run_uri()}/{ATTEMPTS_SUBDIR}"
        self.steps_uri = steps_uri
        self.progress = AttemptProgress(attempts_uri) if attempts_uri and rank == 0 else None
        self.first_step_s: float | None = None
        self._durations = array("d")
        self._waits = array("d")
        self._data_wait = 0.0
        self._trace_dir: str | None = None
        self.trace_uri: str | None = None

    # -- timing --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Time one training step (and trace it, when it is in the profile window).

        :param number: the step's number, as the loop counts (the first step of a fresh run is 0).
        """
        self._start_trace(number)
        annotation = self._annotation(number)
        self._data_wait = 0.0
        started = time.perf_counter()
        with annotation:
            yield
        took = time.perf_counter() - started
        if self.first_step_s is None:
            self.first_step_s = took
        else:
            self._durations.append(took)
            self._waits.append(min(self._data_wait, took))
        if self.progress is not None:
            self.progress.stepped(number)
        if self.window is not None and number + 1 >= self.window[1]:
            self._stop_trace()

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """Time the part of the current step spent waiting for its batch."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait += time.perf_counter() - started

    def summary(self) -> dict[str, Any]:
        """This worker's step times: ``steps``, ``median_s``, ``p95_s``, ``data_wait_share``, ``first_step_s``."""
        timed = sorted(self._durations)
        total = sum(self._durations)
        return {
            "rank": self.rank,
            "steps": len(timed) + (self.first_step_s is not None),
            "median_s": statistics.median(timed) if timed else None,
            "p95_s": percentile(timed, 0.95) if timed else None,
            "data_wait_share": (sum(self._waits) / total) if total > 0 else None,
            "first_step_s": self.first_step_s,
            "trace_uri": self.trace_uri,
        }

    def close(self) -> None:
        """Stop a trace still running, and write this worker's summary (and rank 0 its attempt's progress)."""
        self._stop_trace()
        if self.progress is not None:
            self.progress.close()
        if self.steps_uri:
            from airflow_provider_raytpu.workloads.storage import resolve, write_file

            data = json.dumps(self.summary(), sort_keys=True).encode()
            write_file(resolve(self.steps_uri).child(f"worker-{self.rank}.json"), data)

    def __enter__(self) -> StepClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- profiling -----------------------------------------------------------------------------

    def _in_window(self, number: int) -> bool:
        return self.window is not None and self.window[0] <= number < self.window[1]

    def _annotation(self, number: int) -> contextlib.AbstractContextManager[Any]:
        if self._trace_dir is None:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.StepTraceAnnotation("train", step_num=number)

    def _start_trace(self, number: int) -> None:
        if self._trace_dir is not None or not self._in_window(number) or not self.profile_uri:
            return
        import jax

        self._trace_dir = tempfile.mkdtemp(prefix="raytpu-trace-")
        jax.profiler.start_trace(self._trace_dir)

    def _stop_trace(self) -> None:
        if self._trace_dir is None:
            return
        import jax

        from airflow_provider_raytpu.workloads.storage import resolve, write_file

        local, self._trace_dir = self._trace_dir, None
        try:
            jax.profiler.stop_trace()
            assert self.window is not None and self.profile_uri is not None
            run = f"steps-{self.window[0]}-{self.window[1]}"
            target = resolve(self.profile_uri).child(TRACE_PLUGIN_DIR, run)
            for path in _trace_files(local):
                # jax names each file after the host; local workers share one, so name them by rank.
                write_file(target.child(f"worker-{self.rank}{_trace_suffix(path)}"), _read(path))
            self.trace_uri = target.uri
        finally:
            shutil.rmtree(local, ignore_errors=True)


def _trace_files(local: str) -> list[str]:
    """The files of the one trace ``jax.profiler`` wrote below ``local/plugins/profile/<timestamp>/``."""
    root = os.path.join(local, *TRACE_PLUGIN_DIR.split("/"))
    runs = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if not runs:
        return []
    run = os.path.join(root, runs[-1])
    return [os.path.join(run, name) for name in sorted(os.listdir(run))]


def _trace_suffix(path: str) -> str:
    """``.xplane.pb`` of ``<host>.xplane.pb`` (a host name may hold dots too)."""
    name = os.path.basename(path)
    known = next((s for s in TRACE_SUFFIXES if name.endswith(s)), None)
    return known or f".{name}"


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def read_step_times(steps_uri: str) -> list[dict[str, Any]]:
    """The summaries the workers wrote at :meth:`StepClock.close` (none when the loop has no clock).

    :param steps_uri: the run's ``steps`` directory.
    """
    from airflow_provider_raytpu.workloads.storage import list_files, resolve

    location = resolve(steps_uri)
    summaries = []
    for path in list_files(steps_uri):
        if path.endswith(".json"):
            with location.filesystem.open_input_stream(path) as handle:
                summaries.append(json.loads(handle.read()))
    return sorted(summaries, key=lambda s: s.get("rank", 0))


def combine_step_times(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One summary for the run: the workers step together, so the slowest worker's figures count.

    ``median_s`` and ``p95_s`` are the largest of the workers', ``data_wait_share`` the largest
    share, ``steps`` those of the worker that timed the most; ``None`` without summaries.

    :param summaries: :func:`read_step_times`.
    """
    if not summaries:
        return None

    def largest(key: str) -> float | None:
        values = [s[key] for s in summaries if s.get(key) is not None]
        return max(values) if values else None

    return {
        "workers": len(summaries),
        "steps": max(int(s.get("steps") or 0) for s in summaries),
        "median_s": largest("median_s"),
        "p95_s": largest("p95_s"),
        "data_wait_share": largest("data_wait_share"),
        "first_step_s": largest("first_step_s"),
    }

