"""Read task logs the way a user reads them in the Airflow UI, and say what would bother them.

``dag.test()`` prints every task's log to stdout (structlog's console lines:
``<time> [<level>] <message> [<logger>] key=value ...``) between ``[DAG TEST] starting
task_id=...`` and ``[DAG TEST] end task task_id=...``; whatever a task writes to stderr
itself arrives separately (in a deployment every stderr line of a task shows at error
level). :func:`problems` lists what a user should not see:

- terminal escape sequences (``\\x1b[36m``);
- Ray's own INFO lines on stderr (``... INFO dashboard_sdk.py:371 -- Uploading package``),
  which a deployment shows as errors;
- a training step logged more than once (one line per worker instead of one per step);
- a task silent for more than 10 s while its code runs (or its trigger waits).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import pytest

from airflow_provider_raytpu.dashboard.job_log import strip_ansi

SILENCE_LIMIT_SECONDS = 10.0
# Every wait logs at least every 8 s (checked exactly against SILENCE_LIMIT_SECONDS in
# tests/unit/test_task_view.py); tests that run real Ray and Airflow on a loaded 2-core machine
# allow more, since an import or a package upload can stall a task's next line there, and a
# timing bound must not make them flaky. A wait with no progress line at all still shows.
LOADED_SILENCE_LIMIT_SECONDS = 25.0
_LINE = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z) \[(?P<level>\w+)\s*\] (?P<rest>.*)$")
_LOGGER = re.compile(r" \[(?P<logger>[A-Za-z_][\w.]*)\](?= |$)")
_START = re.compile(r"\[DAG TEST\] starting task_id=(?P<task>\S+)")
_END = re.compile(r"\[DAG TEST\] end task task_id=(?P<task>\S+)")
_TASK_STARTED = re.compile(r" ti_id=(?P<ti>[0-9a-f-]{36})")
# Ray's PlainRayHandler format: "2026-12-03 09:07:12,134\tINFO dashboard_sdk.py:371 -- Uploading ..."
_RAY_PLAIN_INFO = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+INFO \S+:\d+ -- ")
_WORKER_PREFIX = re.compile(r"^\((?P<actor>[^)]*?)(?: pid=\d+)?(?:, ip=[\d.]+)?\)\s*")
_STEP = re.compile(r"\bstep (?P<step>\d+)\b")


@dataclass
class LogLine:
    """One line of a task log: its time and logger when structlog wrote it, else only its text."""

    text: str
    time: datetime | None = None
    logger: str = ""
    message: str = ""


@dataclass
class TaskLog:
    """Everything one try of a task logged, in order."""

    task_id: str
    lines: list[LogLine] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(line.text for line in self.lines)

    def ray_job_lines(self) -> list[str]:
        """The Ray job's own lines, as the task streamed them (after the ``[ray job]`` marker)."""
        return [line.message.split("[ray job] ", 1)[1] for line in self.lines if "[ray job] " in line.message]

    def provider_lines(self) -> list[LogLine]:
        """Lines this provider's operators, sensors and triggers logged, with their times."""
        return [line for line in self.lines if line.time is not None and "airflow_provider_raytpu" in line.logger]


def parse_line(text: str) -> LogLine:
    match = _LINE.match(text)
    if match is None:
        return LogLine(text, message=text)
    rest = match["rest"]
    loggers = list(_LOGGER.finditer(rest))
    logger = loggers[-1]["logger"] if loggers else ""
    message = rest[: loggers[-1].start()] if loggers else rest
    when = datetime.strptime(match["time"][:26].rstrip("Z"), "%Y-%m-%dT%H:%M:%S.%f")
    return LogLine(text, when, logger, message.rstrip())


def task_logs(stdout: str, task_instances: Mapping[str, str] | None = None) -> list[TaskLog]:
    """Each task's log from ``dag.test()``'s output, in the order they ran.

    With ``task_instances`` (task instance id -> task id, e.g. from ``TaskOutcome.ti_id``) a
    task's lines are those from the API server's ``Task started ... ti_id=<id>`` on, its
    deferral, trigger and resumption included. Without, they are those between the
    ``[DAG TEST] starting/end task`` lines, which Airflow writes to the stream that was
    stdout when its logging was configured: a capture that began later may not see them.
    """
    logs: dict[str, TaskLog] = {}
    current: TaskLog | None = None
    for text in stdout.splitlines():
        line = parse_line(text)
        if task_instances is not None:
            started = _TASK_STARTED.search(text) if line.message == "Task started" else None
            if started and started["ti"] in task_instances:
                current = logs.setdefault(started["ti"], TaskLog(task_instances[started["ti"]]))
                continue
        elif started := _START.search(line.message):
            current = logs.setdefault(f"{len(logs)}", TaskLog(started["task"]))
            continue
        elif _END.search(line.message):
            current = None
            continue
        if current is not None and not _START.search(line.message) and not _END.search(line.message):
            current.lines.append(line)
    return list(logs.values())


def task_instances_in(text: str, dag_id: str) -> dict[str, str]:
    """Task instance id -> task id, read from ``airflow dags test``'s own lines
    (``[DAG TEST] running task <TaskInstance: <dag>.<task> ... ti_id=<id>>``), for a run in another process."""
    running = re.compile(rf"<TaskInstance: {re.escape(dag_id)}\.(?P<task>[\w.-]+) .*? ti_id=(?P<ti>[0-9a-f-]{{36}})>")
    return {match["ti"]: match["task"] for match in running.finditer(text)}


def ansi_lines(log: TaskLog) -> list[str]:
    return [line.text for line in log.lines if "\x1b" in line.text]


def ray_info_on_stderr(stderr: str) -> list[str]:
    """Ray INFO lines written to stderr: a deployment would show each as an error."""
    return [line for line in stderr.splitlines() if _RAY_PLAIN_INFO.match(line)]


def repeated_steps(log: TaskLog) -> dict[str, int]:
    """Job lines about a training step that appear more than once (e.g. once per worker), with their count."""
    bare = [_WORKER_PREFIX.sub("", strip_ansi(line)) for line in log.ray_job_lines()]
    counts = Counter(line for line in bare if _STEP.search(line))
    return {line: count for line, count in counts.items() if count > 1}


def running_lines(log: TaskLog) -> list[LogLine]:
    """Timed lines from when the task's own code starts (Airflow's pre-execute group ends) to when it ends
    (Airflow's post-execute group starts), a deferral and its trigger included."""
    timed = [line for line in log.lines if line.time is not None]
    starts = [i for i, line in enumerate(timed) if line.logger == "task" and line.message == "::endgroup::"]
    ends = [i for i, line in enumerate(timed) if line.logger == "task" and line.message.startswith("::group::Post")]
    return timed[starts[0]: ends[-1] + 1] if starts and ends and starts[0] < ends[-1] else []


def silences(log: TaskLog, limit: float = SILENCE_LIMIT_SECONDS) -> list[str]:
    """Gaps longer than ``limit`` seconds between two lines while the task's code runs."""
    timed = running_lines(log)
    gaps = []
    for before, after in zip(timed, timed[1:], strict=False):
        seconds = (after.time - before.time).total_seconds()
        if seconds > limit:
            gaps.append(f"{seconds:.1f} s of silence after: {before.message[:160]}")
    return gaps


def waited_seconds(text: str, line: str) -> int:
    """The whole seconds a line of ``text`` says something lasted: ``line`` with ``{s}`` where the figure goes.

    A measured wait prints more than its bound on a loaded machine, so tests read the figure and compare it
    with the bound rather than match one exact number.
    """
    pattern = re.escape(line).replace(re.escape("{s}"), r"(\d+)")
    found = re.search(pattern, text)
    assert found, f"no line like {line!r} in:\n{text[-3000:]}"
    return int(found.group(1))


def problems(stdout: str, stderr: str = "", task_instances: Mapping[str, str] | None = None,
             limit: float = SILENCE_LIMIT_SECONDS) -> dict[str, list[str]]:
    """What a user reading these task logs should not see, by task (``"stderr"`` for the stream itself).

    :param task_instances: task instance id -> task id, see :func:`task_logs`.
    """
    found: dict[str, list[str]] = {}
    for log in task_logs(stdout, task_instances):
        issues = [f"terminal escape codes: {line!r}" for line in ansi_lines(log)]
        issues += [f"logged {count} times: {line}" for line, count in repeated_steps(log).items()]
        issues += silences(log, limit)
        if issues:
            found.setdefault(log.task_id, []).extend(issues)
    if ray_lines := ray_info_on_stderr(stderr):
        found["stderr"] = [f"Ray INFO at error level: {line}" for line in ray_lines]
    return found


@dataclass
class Captured:
    """What the process printed while a block ran."""

    out: str = ""
    err: str = ""


@contextlib.contextmanager
def captured_output(config: pytest.Config) -> Iterator[Captured]:
    """What ``dag.test()`` prints while the block runs, for a module-scoped fixture (``capfd`` is per test).

    Reads pytest's own capture and hands everything back to it afterwards, so a failing test
    still shows it. Empty when pytest does not capture (``-s``).
    """
    capman = config.pluginmanager.getplugin("capturemanager")
    capturing = capman is not None and capman.is_globally_capturing()
    before = capman.read_global_capture() if capturing else None
    result = Captured()
    try:
        yield result
    finally:
        if capturing:
            during = capman.read_global_capture()
            result.out, result.err = during.out, during.err
            sys.stdout.write(before.out + during.out)
            sys.stderr.write(before.err + during.err)
