"""A Ray job's log as lines a task log can show: no terminal colour codes, no progress-bar redraws.

Ray colours the prefix of every line a worker prints (``\\x1b[36m(RayTrainWorker pid=12)\\x1b[0m``)
and a progress bar redraws itself with carriage returns; Airflow's log view shows both as
raw bytes. A few tracebacks of Ray's own actors are expected and harmless
(:data:`KNOWN_RAY_TRACEBACKS`); each shows as one line that says so. A traceback a Ray actor or
worker printed (Ray Train's workers and controller each print the train loop's error) shows as its
first and last lines: the job's own traceback, which its driver prints last, is the one shown in full
once, and the task's error names its exception and place (:func:`job_error`). The full log stays in
the Ray dashboard, unchanged.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_raytpu.workloads.failures import as_written

# CSI sequences (colours, cursor moves) and the two-byte escapes; what terminals interpret.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
# "(PlacementGroupCleaner pid=7244) ..." or "(RayTrainWorker pid=12, ip=10.0.0.3) ...": a line a Ray actor printed.
_ACTOR_LINE = re.compile(r"^\((?P<actor>\w+) pid=\d+(?:, ip=[\d.]+)?\) ?(?P<text>.*)$")
_TRACEBACK_LINE = re.compile(
    r"^(\s|Traceback \(most recent call last\)|Exception in thread |[\w.]+(Error|Exception)\b)")
# Ray's note on a line several actors printed, the first time with a hint (ray/_private/ray_logging, _warn_once).
_REPEATED = re.compile(r" \[repeated \d+x across cluster\](?: \(Ray deduplicates logs by default\.[^)]*\))?$")
# What a folded traceback's header says instead of its frames.
_FRAMES_ELSEWHERE = " (frames: in the Ray dashboard's job log)"
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
#: How many of the driver's last lines may follow its traceback's exception line (the trainer's "error:" line).
_AFTER_TRACEBACK = 3
# Tracebacks of Ray's own actors that are expected and harmless: one line says what happened instead.
KNOWN_RAY_TRACEBACKS = {
    "PlacementGroupCleaner": (
        "Ray Train's placement-group cleaner could not reach the GCS and stopped watching (a Ray-internal "
        "monitor that only acts if the Train controller dies; training is unaffected; the traceback is in "
        "the job's log in the Ray dashboard)"
    ),
}

RESULT_SHOWN_CHARS = 400
#: Flags whose JSON value may hold secrets: the task log shows its keys only.
SECRET_FLAGS = ("--config", "--transform-kwargs")
# A secret flag and its value wherever a command is repeated: the job supervisor's first line
# ("Running entrypoint for job ...: <command>", ray/dashboard/modules/job/job_supervisor.py), and
# the job's failure message, which quotes the log's last lines. The value as shlex.join quotes
# it ('...' with '"'"' for a quote inside), double-quoted, or a bare word.
_SECRET_ARGUMENT = re.compile(
    r"(?P<flag>" + "|".join(re.escape(flag) for flag in SECRET_FLAGS) + r")(?P<sep>\s+|=)"
    r"(?P<value>'(?:[^']|'\"'\"')*'|\"(?:[^\"\\]|\\.)*\"|[^\s'\"]\S*)")


def closing_line(submission_id: str, status: str, seconds: float | None, outcome: str) -> str:
    """The last line a job task logs: the job, how it ended, how long it ran, what it returned (or why it failed)."""
    took = f" after {seconds:.1f} s" if seconds is not None else ""
    return f"Ray job {submission_id} {status}{took}; {outcome}"


def returned(result: Any) -> str:
    """A job's result for the closing line, cut short when long (the XCom has all of it)."""
    if result is None:
        return "returned nothing (no RAYTPU_RESULT line)"
    text = json.dumps(result, sort_keys=True)
    return "returned " + (text if len(text) <= RESULT_SHOWN_CHARS else text[: RESULT_SHOWN_CHARS - 3] + "...")


def _keys_only(value: str) -> str:
    """A secret flag's JSON value as its keys only: ``<JSON with keys: a, b>`` (``<JSON>`` when not an object)."""
    if value.startswith("<JSON"):  # shown already
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    keys = ", ".join(str(k) for k in parsed) if isinstance(parsed, dict) else ""
    return f"<JSON with keys: {keys}>" if keys else "<JSON>"


def shown_command(args: Sequence[Any]) -> str:
    """A command for the task log: the JSON after ``--config`` / ``--transform-kwargs`` (which may
    hold secrets) is shown as its keys only.

    :param args: the command's arguments.
    """
    shown: list[str] = []
    for arg in (str(a) for a in args):
        shown.append(_keys_only(arg) if shown and shown[-1] in SECRET_FLAGS else arg)
    return shlex.join(shown)


def mask_secret_arguments(text: str) -> str:
    """``text`` with the value of every ``--config`` / ``--transform-kwargs`` in it shown as its keys only.

    For whatever repeats a job's command: its log's first line, Ray's failure message (which
    quotes the log's last lines), a log tail, an exception. Idempotent.

    :param text: any text.
    """
    def keys_only(match: re.Match[str]) -> str:
        raw = match["value"]
        try:
            value = shlex.split(raw)[0] if raw[0] in "'\"" else raw
        except (ValueError, IndexError):
            value = raw
        return match["flag"] + match["sep"] + shlex.quote(_keys_only(value))

    if not any(flag in text for flag in SECRET_FLAGS):
        return text
    return _SECRET_ARGUMENT.sub(keys_only, text)


# Ray's message for a failed job repeats the log's last lines (job_supervisor.py); the task shows its own tail.
_RAY_LOG_TAIL = re.compile(r", last available logs \(truncated to [\d,]+ chars\):\n.*", re.DOTALL)


def job_message(message: str | None) -> str:
    """Ray's message about how a job ended, as a task shows it: without the log lines Ray quotes in it
    (the task's error has the tail of the log already), secret arguments shown by their keys.

    :param message: the ``message`` of the job's details.
    """
    return mask_secret_arguments(strip_ansi(_RAY_LOG_TAIL.sub("", message or "")))


def shown_tail(log: str, lines: int) -> str:
    """The last ``lines`` lines of a job's log as a task's error shows them: :func:`readable_lines` (no escape
    codes or redraws), secret arguments by their keys.

    :param log: the log, or its end.
    :param lines: how many lines.
    """
    return "\n".join(mask_secret_arguments(line) for line in readable_lines(log)[-lines:])


def shown_entrypoint(command: str) -> str:
    """``command`` as the task log shows it: :func:`shown_command` when it has a secret flag.

    :param command: the command as one string.
    """
    try:
        args = shlex.split(command)
    except ValueError:
        return command
    return shown_command(args) if set(args) & set(SECRET_FLAGS) else command


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences.

    :param text: a line or a whole log.
    """
    return _ANSI.sub("", text)


def readable_lines(text: str) -> list[str]:
    """The lines of a chunk of job log as a task log should show them.

    Escape sequences are removed; of a line redrawn with carriage returns only its last
    state is kept; blank lines are dropped.

    :param text: whole lines of the job's log.
    """
    lines = []
    for raw in text.split("\n"):  # not splitlines(): a carriage return redraws a line, it does not end one
        line = strip_ansi(raw.rstrip("\r")).rsplit("\r", 1)[-1].rstrip()
        if line.strip():
            lines.append(line)
    return lines


class JobLogFollower:
    """Shows the whole lines of a job's log, chunk after chunk, as :func:`readable_lines`; a known Ray
    traceback (:data:`KNOWN_RAY_TRACEBACKS`) as one line that explains it, the first time only; another
    Ray actor's traceback as its header and exception line (a traceback may span chunks).
    """

    def __init__(self) -> None:
        self._explained: set[str] = set()
        self._in_traceback: set[str] = set()  # the prefixes ("(RayTrainWorker pid=12)") inside a traceback

    def shown(self, text: str) -> list[str]:
        """Whole lines of the job's log as the task log shows them (the caller tracks its place in the log).

        :param text: whole lines of the job's log.
        """
        shown = []
        for line in readable_lines(text):
            line = mask_secret_arguments(line)
            actor = known_traceback_of(line)
            if actor is not None:
                if actor not in self._explained:
                    self._explained.add(actor)
                    shown.append(f"({actor}) {KNOWN_RAY_TRACEBACKS[actor]}")
            elif (folded := self._folded(line)) is not None:
                shown.extend(folded)
            else:
                shown.append(line)
        return shown

    def _folded(self, line: str) -> list[str] | None:
        """What a line of a Ray actor's traceback shows (its header, then its exception line); ``None`` for
        any other line."""
        match = _ACTOR_LINE.match(line)
        if match is None:
            return None
        prefix, text = line[: len(line) - len(match["text"])].rstrip(), _REPEATED.sub("", match["text"])
        if not text:
            return []  # Ray's prefix before an empty line: nothing to read
        if text == "Traceback (most recent call last):":
            self._in_traceback.add(prefix)
            return [f"{line}{_FRAMES_ELSEWHERE}"]
        if prefix not in self._in_traceback:
            if _FRAME.match(text) is None:
                return None
            # A frame without its header: Ray's log deduplication held the header back as another actor's.
            self._in_traceback.add(prefix)
            return [f"{prefix} Traceback (most recent call last):{_FRAMES_ELSEWHERE}"]
        if text[0].isspace():
            return []
        self._in_traceback.discard(prefix)  # its exception line
        return [line]


@dataclass(frozen=True)
class JobError:
    """The exception a job's driver ended with, from the traceback it printed last.

    :param exception: its last line (``ValueError: could not convert string to float: 'fast'``).
    :param where: its innermost frame (``pipeline/train_loop.py, line 101, in train``).
    """

    exception: str
    where: str


def job_error(log: str) -> JobError | None:
    """The exception the job's driver ended with: the last frame of a traceback among the driver's own last
    lines (not a Ray actor's), and the exception line after it; ``None`` when the log does not end so.

    :param log: the job's log, or its end.
    """
    driver = [line for line in readable_lines(log) if not _ACTOR_LINE.match(line)]
    for index in range(len(driver) - 1, -1, -1):
        frame = _FRAME.match(driver[index])
        if frame is None:
            continue
        after = [i for i in range(index + 1, len(driver)) if not driver[i][0].isspace()]
        if not after or len(driver) - after[0] > _AFTER_TRACEBACK:
            return None
        where = f"{as_written(frame['file'])}, line {frame['line']}, in {frame['function']}"
        return JobError(mask_secret_arguments(driver[after[0]]), where)
    return None


def known_traceback_of(line: str) -> str | None:
    """The Ray actor of :data:`KNOWN_RAY_TRACEBACKS` whose traceback ``line`` belongs to, else ``None``.

    :param line: a readable job log line.
    """
    match = _ACTOR_LINE.match(line)
    if match and match["actor"] in KNOWN_RAY_TRACEBACKS and _TRACEBACK_LINE.match(match["text"]):
        return match["actor"]
    return None
