"""How a training that failed reads at the end of its job's log: the train loop's own traceback, without the
provider's frames and with package paths as the user wrote them, then one line naming the ranks that raised it.

Ray Train's ``WorkerGroupError`` says "Training failed due to worker errors: [Rank 0,1 Error Snippet]:" and
then the traceback; the task shows the traceback's last frame and exception line as its error
(``dashboard/job_log.job_error``). Standard library only.
"""

from __future__ import annotations

import re

# "  File "/tmp/ray/session_.../runtime_resources/py_modules_files/_ray_pkg_ab12/pipeline/train_loop.py", ..."
# -> "pipeline/train_loop.py": where Ray unpacked a py_modules or working_dir package on the node.
RAY_PACKAGE_DIR = re.compile(r"[^\s\"']*/runtime_resources/[a-z_]+_files/_ray_pkg_[0-9a-f]+/")
_SNIPPET = re.compile(r"^\[Rank (?P<ranks>[\d,]+) Error Snippet\]:\n", re.MULTILINE)
_PROVIDER_FRAME = re.compile(r'^  File "[^"]*/airflow_provider_raytpu/workloads/[^"]*", line \d+, in ')


def as_written(text: str) -> str:
    """``text`` with paths inside Ray's unpacked job packages relative to the package, as the user wrote them.

    :param text: a traceback or a line of one.
    """
    return RAY_PACKAGE_DIR.sub("", text)


def user_traceback(traceback_text: str) -> str:
    """A worker's traceback without the provider's own frames (the call into the train loop).

    :param traceback_text: a formatted traceback (``Traceback (most recent call last):`` ... exception line).
    """
    kept, skipping = [], False
    for line in traceback_text.rstrip("\n").splitlines():
        if line.startswith('  File "'):
            skipping = bool(_PROVIDER_FRAME.match(line))
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(as_written(line))
    return "\n".join(kept)


def describe_failure(error: BaseException) -> str:
    """What the driver prints when training failed: the traceback of the first group of ranks that raised (as
    Ray Train's ``WorkerGroupError`` quotes it, one "[Rank 0,1 Error Snippet]:" per distinct error, in
    ray/train/v2/_internal/execution/worker_group/poll.py), once, then which ranks failed.

    :param error: Ray Train's ``TrainingFailedError``.
    """
    text = str(error)
    snippets = list(_SNIPPET.finditer(text))
    if not snippets:
        return f"error: training failed: {as_written(text)}"
    first = snippets[0]
    body = text[first.end(): snippets[1].start() if len(snippets) > 1 else len(text)].strip("\n")
    shown = user_traceback(body) if body.startswith("Traceback") else as_written(body)
    line = f"error: training failed on {_ranks(first['ranks'])}"
    if len(snippets) > 1:
        others = _ranks(",".join(snippet["ranks"] for snippet in snippets[1:]))
        line += f"; {others} failed otherwise (Ray Train's controller says how, above)"
    return f"{shown}\n{line}"


def _ranks(listed: str) -> str:
    ranks = listed.split(",")
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"
