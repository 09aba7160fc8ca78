"""An output prefix a task owns: replaced by a rerun of that task, never anything else's, one writer at a time.

A job that writes ``gs://bucket/clean`` again (a retry, a rerun of the same date) replaces its
own earlier output; it must not delete files it did not write. So every output carries a
record, the object ``_raytpu_output.json`` beside its files (the leading ``_`` keeps Ray
Data, pyarrow and Spark readers from taking it for data), saying who wrote it (the task:
DAG, task and map index), which files are the output and which write made them (its
``version``). Replacing removes only the files a record of the same task lists; a prefix
holding anything else is refused.

Several runs of one task may write one output at once (a backfill, ``max_active_runs > 1``).
Each attempt writes its new files to a staging prefix of its own,
``<uri>.raytpu-tmp/run-<run>-try<n>-<id>/``, then replaces the output under the output's lease
(:mod:`~airflow_provider_raytpu.workloads.lease`): one swap at a time, the last to swap wins, and
the output always holds one run's files. The swap never loses a complete copy:

1. ``_SUCCESS`` is removed; the record lists the new files as ``pending`` and they are moved in
   beside the old ones (new write, new file names: nothing is overwritten);
2. the record lists the new files as the output and the old ones as ``superseded`` (the commit);
3. the old files are deleted, the record rewritten with the new files only, ``_SUCCESS`` written
   (present only while the prefix holds exactly one complete version, as Hadoop's and Spark's
   committers write it), the staging prefix deleted.

A crash before step 2 leaves the old output complete (and the new files listed as pending);
after it, the new output complete (and the old files listed as superseded). The next writer
removes what the record lists as pending or superseded, and the staging prefix of a writer whose
lease it took over, before it swaps. The provider's readers read the files the record lists
(:func:`committed_files`), so a read never mixes two versions.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.lease import (
    DEFAULT_TTL_S,
    DEFAULT_WAIT_S,
    LEASE_NAME,
    LOCK_NAME,
    Lease,
    OutputLease,
    OutputLeaseBusyError,
    describe_holder,
)
from airflow_provider_raytpu.workloads.storage import Location, delete_prefix, resolve, write_file
from airflow_provider_raytpu.workloads.uris import overlap

RECORD_NAME = "_raytpu_output.json"
SUCCESS_NAME = "_SUCCESS"
#: Objects in an output prefix that are its bookkeeping, not its data.
BOOKKEEPING = frozenset({RECORD_NAME, SUCCESS_NAME, LEASE_NAME, LOCK_NAME})
TEMP_SUFFIX = ".raytpu-tmp"
SHOWN_FILES = 5
MOVES_AT_ONCE = 16


class OutputNotOwnedError(Exception):
    """The output prefix holds files this task did not write: nothing is deleted."""


@dataclass
class OutputRecord:
    """What an output prefix's record says.

    :param owner: the task that wrote it (e.g. ``{"dag_id", "task_id", "map_index"}`` as JSON text).
    :param files: the output's files, relative to the prefix.
    :param pending: files of a new output being moved in (not the output yet).
    :param superseded: files of the previous output being removed (not the output any more).
    :param version: which write made ``files`` (its staging prefix's name); empty before the first.
    :param writer: who made them (the task and its run and try).
    """

    owner: str
    files: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    superseded: list[str] = field(default_factory=list)
    version: str = ""
    writer: dict[str, Any] = field(default_factory=dict)

    def listed(self) -> set[str]:
        return {*self.files, *self.pending, *self.superseded}

    def to_json(self) -> bytes:
        return json.dumps({"owner": self.owner, "files": self.files, "pending": self.pending,
                           "superseded": self.superseded, "version": self.version, "writer": self.writer},
                          indent=1).encode()


def read_record(location: Location) -> OutputRecord | None:
    """The record of the output at ``location``, or ``None`` when there is none (or it is not ours to read)."""
    path = posixpath.join(location.path, RECORD_NAME)
    try:
        with location.filesystem.open_input_stream(path) as stream:
            data = json.loads(stream.read())
    except (FileNotFoundError, OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("owner"), str):
        return None
    files, pending, superseded = (list(data.get(key) or []) for key in ("files", "pending", "superseded"))
    return OutputRecord(data["owner"], files, pending, superseded, version=str(data.get("version") or ""),
                        writer=dict(data.get("writer") or {}))


def committed_files(location: Location) -> tuple[list[str], str] | None:
    """The paths (inside the filesystem) of the output version committed at ``location``, and its version;
    ``None`` when no record is there (a prefix this provider did not write: read it whole).

    :param location: an output prefix.
    """
    record = read_record(location)
    if record is None:
        return None
    return [location.child(name).path for name in record.files], record.version


def write_record(location: Location, record: OutputRecord) -> None:
    write_file(location.child(RECORD_NAME), record.to_json())


def files_under(location: Location) -> list[str]:
    """The files under ``location``, relative to it, its bookkeeping and hidden files (a file being written)
    left out; empty when nothing is there."""
    selector = pafs.FileSelector(location.path, recursive=True, allow_not_found=True)
    try:
        infos = location.filesystem.get_file_info(selector)
    except NotADirectoryError:  # a single file where the prefix should be
        return [posixpath.basename(location.path)]
    found = (posixpath.relpath(info.path, location.path) for info in infos if info.type == pafs.FileType.File)
    return sorted(name for name in found if name not in BOOKKEEPING and not posixpath.basename(name).startswith("."))


def _shown(names: Sequence[str]) -> str:
    more = f" and {len(names) - SHOWN_FILES} more" if len(names) > SHOWN_FILES else ""
    return ", ".join(names[:SHOWN_FILES]) + more


def claim(location: Location, owner: str) -> OutputRecord | None:
    """The record of ``owner``'s earlier output at ``location`` (``None``: nothing there yet).

    :raises OutputNotOwnedError: files there that no record of ``owner`` lists.
    """
    present = files_under(location)
    record = read_record(location)
    if record is not None and record.owner != owner:
        theirs, mine = _owner_fields(record.owner), _owner_fields(owner)
        legacy = "deployment" not in theirs and {**theirs, "deployment": mine.get("deployment")} == mine
        fix = ("It was written before this provider recorded the Airflow deployment: if it is this deployment's, "
               "delete it (or write a new prefix) once" if legacy else "Give this task an output prefix of its own")
        raise OutputNotOwnedError(
            f"{location.uri} is the output of another task ({record.owner}), not of this one ({owner}); "
            f"nothing was deleted. {fix}")
    if unknown := sorted(set(present) - (record.listed() if record else set())):
        raise OutputNotOwnedError(
            f"{location.uri} holds {len(unknown)} file(s) this task did not write ({_shown(unknown)}); nothing was "
            f"deleted. Choose an empty or new output prefix, or remove those files yourself (an output this task "
            f"wrote carries {RECORD_NAME}, which lists its files)")
    return record


def _delete(location: Location, names: Sequence[str]) -> None:
    def delete(name: str) -> None:
        try:
            location.filesystem.delete_file(posixpath.join(location.path, name))
        except FileNotFoundError:
            pass

    with ThreadPoolExecutor(MOVES_AT_ONCE) as pool:
        list(pool.map(delete, names))


def finish_interrupted_swap(location: Location, record: OutputRecord) -> OutputRecord:
    """Remove what a crashed swap left (files listed as pending or superseded); the record of the output."""
    if not (record.pending or record.superseded):
        return record
    _delete(location, [*record.pending, *record.superseded])
    record = OutputRecord(record.owner, record.files, version=record.version, writer=record.writer)
    write_record(location, record)
    return record


def replace_output(uri: str, owner: str, write: Callable[[Location], Any], attempt: Mapping[str, Any] | None = None,
                   lease_ttl: float = DEFAULT_TTL_S, lease_wait: float = DEFAULT_WAIT_S,
                   progress: Callable[[str], None] = print) -> tuple[Location, str]:
    """Make ``uri`` hold exactly what ``write`` writes, replacing ``owner``'s earlier output there; where, and
    the version committed.

    :param uri: the output prefix (not a whole bucket).
    :param owner: who writes it; an output of another owner, or files no record lists, are refused.
    :param write: writes the new output's files under the :class:`Location` it is given (this attempt's
        staging prefix), e.g. ``lambda at: dataset.write_parquet(at.path, filesystem=at.filesystem)``.
    :param attempt: which run and try of the owner writes (``{"run_id", "try_number"}``): names its staging
        prefix, and is shown to writers waiting for the lease. One job at a time runs per run of a task, so
        a run's earlier tries are over: their staging is removed.
    :param lease_ttl: seconds the output's lease lasts without renewal (see :class:`OutputLease`).
    :param lease_wait: seconds to wait for another writer's swap before giving up.
    :param progress: receives the lines a waiting writer prints.
    :raises OutputNotOwnedError: see :func:`claim`.
    :raises OutputLeaseBusyError: another writer held the lease for ``lease_wait`` seconds.
    """
    target = resolve(uri)
    if target.is_gcs and "/" not in target.path:
        raise ValueError(f"{target.uri} is a whole bucket; give a prefix inside it, e.g. {target.uri}/output")
    writer = {**_owner_fields(owner), **(attempt or {})}
    staging_root = target.sibling(target.name + TEMP_SUFFIX)
    staging = staging_root.child(staging_name(owner, attempt))
    claim(target, owner)  # refused before anything is written; checked again under the lease
    _clear_earlier_tries(staging_root, staging.name)
    write_record(staging, OutputRecord(owner, version=staging.name, writer=writer))
    write(staging)
    new = files_under(staging)
    lease = OutputLease(target, writer, staging.uri, ttl=lease_ttl, wait=lease_wait, progress=progress)
    try:
        previous = lease.acquire()
    except OutputLeaseBusyError:
        delete_prefix(staging.uri)  # this attempt never started its swap: its staging is of no use
        raise
    try:
        if previous is not None:
            _clear_staging_of(previous, staging_root, progress)
        _swap(target, owner, staging, new, lease)
    finally:
        lease.release()
    return target, staging.name


def _swap(target: Location, owner: str, staging: Location, new: list[str], lease: OutputLease) -> None:
    """Steps 1-3 of the module docstring, under ``lease`` (confirmed before each change of the record)."""
    record = claim(target, owner)
    old = finish_interrupted_swap(target, record).files if record else []
    if clash := sorted(set(new) & set(old)):
        raise RuntimeError(f"the new output's files {_shown(clash)} have the names of the old ones: not replacing")
    writer, version = lease.lease.holder, staging.name
    lease.confirm()
    _delete(target, [SUCCESS_NAME])
    write_record(target, OutputRecord(owner, old, pending=new, version=record.version if record else "",
                                      writer=record.writer if record else {}))
    _move_in(staging, target, new)
    lease.confirm()
    write_record(target, OutputRecord(owner, new, superseded=old, version=version, writer=writer))  # the commit
    _delete(target, old)
    write_record(target, OutputRecord(owner, new, version=version, writer=writer))
    success = {"version": version, "files": len(new), "writer": writer, "committed_at": time.time()}
    write_file(target.child(SUCCESS_NAME), json.dumps(success, sort_keys=True).encode())
    delete_prefix(staging.uri)


def _owner_fields(owner: str) -> dict[str, Any]:
    try:
        fields = json.loads(owner)
    except ValueError:
        fields = None
    return dict(fields) if isinstance(fields, dict) else {"owner": owner}


def staging_name(owner: str, attempt: Mapping[str, Any] | None) -> str:
    """``run-<hash of owner, run id and run token>-try<n>-<id>``: apart for every attempt, grouped by run."""
    if not attempt or "run_id" not in attempt:
        return f"write-{uuid.uuid4().hex[:12]}"
    run = [owner, str(attempt["run_id"]), str(attempt.get("run_token", ""))]
    run_prefix = f"run-{hashlib.sha256(json.dumps(run).encode()).hexdigest()[:12]}-"
    return f"{run_prefix}try{attempt.get('try_number', 0)}-{uuid.uuid4().hex[:6]}"


def _clear_earlier_tries(staging_root: Location, name: str) -> None:
    """Remove the staging prefixes of this run's earlier attempts (never another run's)."""
    if not name.startswith("run-"):
        return
    run_prefix = name[: name.index("-try") + 1]
    for child in sorted(_children(staging_root)):
        if child.startswith(run_prefix) and child != name:
            delete_prefix(staging_root.child(child).uri)


def _children(location: Location) -> set[str]:
    """The names of the prefixes directly under ``location`` (from a recursive listing: a GCS prefix with no
    directory marker is not listed as a directory)."""
    return {name.split("/", 1)[0] for name in files_under(location) if "/" in name}


def _clear_staging_of(previous: Lease, staging_root: Location, progress: Callable[[str], None]) -> None:
    """Remove what is left of the previous lease holder's staging prefix: nothing after a swap that finished;
    its files when the swap failed (lease released) or the holder died in it (lease expired, taken over)."""
    if overlap(previous.staging, staging_root.uri) != "inside":
        return  # not a staging prefix of this output: not ours to delete
    if not previous.released:
        progress(f"Took over the lease on {staging_root.uri.removesuffix(TEMP_SUFFIX)} from "
                 f"{describe_holder(previous.holder)}, which stopped renewing it; removing its staging "
                 f"{previous.staging}")
    delete_prefix(previous.staging)


def _move_in(source: Location, target: Location, names: Sequence[str]) -> None:
    """Move the files ``names`` from ``source`` to the same names under ``target`` (on GCS: copy, then delete),
    several at once: each is a round trip to the store."""

    def move(name: str) -> None:
        destination = target.child(name)
        if isinstance(target.filesystem, pafs.LocalFileSystem):
            target.filesystem.create_dir(posixpath.dirname(destination.path), recursive=True)
        target.filesystem.move(source.child(name).path, destination.path)

    with ThreadPoolExecutor(MOVES_AT_ONCE) as pool:
        list(pool.map(move, names))
