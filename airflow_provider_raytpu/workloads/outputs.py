"""An output prefix a task owns: replaced by a rerun of that task, never anything else's.

A job that writes ``gs://bucket/clean`` again (a retry, a rerun of the same date) replaces its
own earlier output; it must not delete files it did not write. So every output carries a
record, the object ``_raytpu_output.json`` beside its files (the leading ``_`` keeps Ray
Data, pyarrow and Spark readers from taking it for data), saying who wrote it (the task:
DAG, task and map index) and which files are the output. Replacing removes only the files
a record of the same task lists; a prefix holding anything else is refused.

The swap never loses a complete copy. The new files are written to the sibling prefix
``<uri>.raytpu-tmp`` (which has a record of its own, written first), then:

1. the record lists the new files as ``pending`` and they are moved in beside the old ones
   (new write, new file names: nothing is overwritten);
2. the record lists the new files as the output and the old ones as ``superseded`` (the commit);
3. the old files are deleted, the record rewritten with the new files only, the temporary
   prefix deleted.

A crash before step 2 leaves the old output complete (and the new files listed as pending);
after it, the new output complete (and the old files listed as superseded). The next run of
the task removes what the record lists as pending or superseded before it writes.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from airflow_provider_raytpu.workloads.storage import Location, delete_prefix, resolve, write_file

RECORD_NAME = "_raytpu_output.json"
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
    """

    owner: str
    files: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    superseded: list[str] = field(default_factory=list)

    def listed(self) -> set[str]:
        return {*self.files, *self.pending, *self.superseded}

    def to_json(self) -> bytes:
        return json.dumps({"owner": self.owner, "files": self.files, "pending": self.pending,
                           "superseded": self.superseded}, indent=1).encode()


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
    return OutputRecord(data["owner"], *(list(data.get(key) or []) for key in ("files", "pending", "superseded")))


def write_record(location: Location, record: OutputRecord) -> None:
    write_file(location.child(RECORD_NAME), record.to_json())


def files_under(location: Location) -> list[str]:
    """The files under ``location``, relative to it, the record left out; empty when nothing is there."""
    selector = pafs.FileSelector(location.path, recursive=True, allow_not_found=True)
    try:
        infos = location.filesystem.get_file_info(selector)
    except NotADirectoryError:  # a single file where the prefix should be
        return [posixpath.basename(location.path)]
    found = (posixpath.relpath(info.path, location.path) for info in infos if info.type == pafs.FileType.File)
    return sorted(name for name in found if name != RECORD_NAME)


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
        raise OutputNotOwnedError(
            f"{location.uri} is the output of another task ({record.owner}), not of this one ({owner}); "
            "nothing was deleted. Give this task an output prefix of its own")
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
    record = OutputRecord(record.owner, record.files)
    write_record(location, record)
    return record


def replace_output(uri: str, owner: str, write: Callable[[Location], Any]) -> Location:
    """Make ``uri`` hold exactly what ``write`` writes, replacing ``owner``'s earlier output there.

    :param uri: the output prefix (not a whole bucket).
    :param owner: who writes it; an output of another owner, or files no record lists, are refused.
    :param write: writes the new output's files under the :class:`Location` it is given (a
        temporary prefix), e.g. ``lambda at: dataset.write_parquet(at.path, filesystem=at.filesystem)``.
    :raises OutputNotOwnedError: see :func:`claim` (for the output and for its temporary prefix).
    """
    target = resolve(uri)
    if target.is_gcs and "/" not in target.path:
        raise ValueError(f"{target.uri} is a whole bucket; give a prefix inside it, e.g. {target.uri}/output")
    temporary = target.sibling(target.name + TEMP_SUFFIX)
    record = claim(target, owner)
    old = finish_interrupted_swap(target, record).files if record else []
    clear_temporary(temporary, owner)
    write_record(temporary, OutputRecord(owner))
    write(temporary)
    new = files_under(temporary)
    if clash := sorted(set(new) & set(old)):
        raise RuntimeError(f"the new output's files {_shown(clash)} have the names of the old ones: not replacing")
    write_record(target, OutputRecord(owner, old, pending=new))
    _move_in(temporary, target, new)
    write_record(target, OutputRecord(owner, new, superseded=old))  # the commit: from here on, the new output
    _delete(target, old)
    write_record(target, OutputRecord(owner, new))
    delete_prefix(temporary.uri)  # now only its record (and directory markers) are left
    return target


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


def clear_temporary(temporary: Location, owner: str) -> None:
    """Empty the temporary prefix of what a crashed attempt of ``owner`` wrote there.

    Its record is written before anything else, so files there under a record of ``owner``
    are that attempt's; files without one are someone else's.

    :raises OutputNotOwnedError: files there without a record of ``owner``.
    """
    leftovers = files_under(temporary)
    if not leftovers:
        return
    record = read_record(temporary)
    if record is None or record.owner != owner:
        raise OutputNotOwnedError(
            f"{temporary.uri}, where this task writes its output before replacing the old one, holds "
            f"{len(leftovers)} file(s) this task did not write ({_shown(leftovers)}); nothing was deleted. Remove "
            "them, or choose another output prefix")
    delete_prefix(temporary.uri)
