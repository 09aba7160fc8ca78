"""Whether two storage URIs overlap, on paper: no I/O, no storage library (DAG parsing imports this).

``gs://b/data/``, ``gs://b/data`` and ``gs://b//data/.`` are one prefix; ``~/data`` is the
home directory's ``data``; ``file:///x`` is the local path ``/x``. Two locations overlap when
they are equal or one lies inside the other, so writing (and replacing) one would delete the
other.
"""

from __future__ import annotations

import os
import posixpath
from urllib.parse import urlparse


def location_key(uri: str) -> tuple[str, ...]:
    """``uri`` as (scheme, bucket or host, path parts...), trailing slashes, ``.``, ``..`` and ``~`` resolved.

    Local paths (no scheme, or ``file://``) are made absolute against the current directory.

    :param uri: ``gs://bucket/prefix``, a local path, ``file:///abs/path`` or another ``scheme://`` URI.
    """
    text = uri.strip()
    parsed = urlparse(text)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # a Windows drive letter is not a scheme
        local = parsed.path if parsed.scheme == "file" else text
        path = os.path.abspath(os.path.expanduser(local))
        return ("file", "", *[part for part in path.split(os.sep) if part])
    path = posixpath.normpath("/" + parsed.path.strip("/"))
    return (parsed.scheme.lower(), parsed.netloc, *[part for part in path.split("/") if part])


def overlap(first: str, second: str) -> str | None:
    """How ``first`` and ``second`` overlap: ``"the same location"``, ``"inside"`` (first is inside
    second), ``"contains"`` (second is inside first), or ``None``.

    :param first: a storage URI.
    :param second: another storage URI.
    """
    a, b = location_key(first), location_key(second)
    if a == b:
        return "the same location"
    if a[: len(b)] == b:
        return "inside"
    if b[: len(a)] == a:
        return "contains"
    return None


class OutputOverlapError(ValueError):
    """An output location overlaps its input: replacing the output would delete the input."""


#: What to do instead, in every message about an output that overlaps its input.
APART_FIX = "Replacing an output deletes what is there: write the output to a prefix of its own, beside the input"


def output_overlap(input_uri: str, output_uri: str) -> str | None:
    """How ``output_uri`` overlaps ``input_uri`` (``"lies inside the input 'gs://b/raw'"``), or ``None``.

    :param input_uri: what a task reads.
    :param output_uri: what it writes (and replaces on a rerun).
    """
    how = overlap(output_uri, input_uri)
    if how is None:
        return None
    where = {"the same location": "is the same location as", "inside": "lies inside", "contains": "contains"}[how]
    return f"{where} the input {input_uri!r}"
