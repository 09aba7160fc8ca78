"""The storage seam: one ``gs://bucket/prefix`` (or local) URI, in the form each library needs.

- Ray Data and Ray Train take a ``pyarrow.fs`` filesystem plus a path inside it
  (``RunConfig(storage_path=loc.path, storage_filesystem=loc.filesystem)``).
- Orbax and TensorStore take the URI itself (``gs://...`` or an absolute local path).

In production a ``gs://`` URI uses Google's default credentials. When
``STORAGE_EMULATOR_HOST`` is set (fake-gcs-server in tests, or any GCS emulator) the
same URI goes to the emulator instead; :func:`emulator_env` gives the environment
variables every process - Ray workers included - needs for that, so a driver can pass
them on in its ``runtime_env``. A plain ``gs://`` URI cannot be pointed at an emulator
by itself, which is why all code goes through :func:`resolve`.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import pyarrow.fs as pafs

GCS_SCHEME = "gs"
EMULATOR_HOST_VAR = "STORAGE_EMULATOR_HOST"
TENSORSTORE_URL_VAR = "TENSORSTORE_GCS_HTTP_URL"
# Without these the emulator half-works: gcsfs waits 60 s on a hierarchical-namespace
# probe, and google clients want a project.
_EMULATOR_DEFAULTS = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "GOOGLE_CLOUD_PROJECT": "test-project",
}


def emulator_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables a process needs to reach the GCS emulator; empty without one.

    Derived from ``STORAGE_EMULATOR_HOST`` in ``environ``; values already set there win
    (``TENSORSTORE_GCS_HTTP_URL`` defaults to the emulator URL - without it orbax hangs).

    :param environ: the environment to read; ``os.environ`` by default.
    """
    env = os.environ if environ is None else environ
    host = env.get(EMULATOR_HOST_VAR, "").strip()
    if not host:
        return {}
    url = host if "://" in host else f"http://{host}"
    result = {EMULATOR_HOST_VAR: url, TENSORSTORE_URL_VAR: env.get(TENSORSTORE_URL_VAR) or url}
    for key, default in _EMULATOR_DEFAULTS.items():
        result[key] = env.get(key) or default
    return result


def apply_emulator_env() -> dict[str, str]:
    """Fill in the emulator variables missing from this process's environment; return them all.

    Call before TensorStore/orbax first touch ``gs://`` in a process that was given only
    ``STORAGE_EMULATOR_HOST``. Does nothing without an emulator.
    """
    env = emulator_env()
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return env


def gcs_filesystem() -> pafs.GcsFileSystem:
    """A pyarrow GCS filesystem: the emulator if ``STORAGE_EMULATOR_HOST`` is set, else default credentials."""
    env = emulator_env()
    if not env:
        return pafs.GcsFileSystem()
    endpoint = urlparse(env[EMULATOR_HOST_VAR])
    return pafs.GcsFileSystem(
        endpoint_override=endpoint.netloc,
        scheme=endpoint.scheme or "http",
        anonymous=True,
        # The emulator answers at once or not at all; don't retry for 15 minutes.
        retry_time_limit=timedelta(seconds=60),
    )


@dataclass(frozen=True)
class Location:
    """One storage location, in every form the libraries want.

    :param uri: the canonical URI: ``gs://bucket/prefix`` or an absolute local path.
    :param filesystem: the pyarrow filesystem (Ray Data, Ray Train).
    :param path: the path inside ``filesystem``: ``bucket/prefix`` or the local path.
    """

    uri: str
    filesystem: pafs.FileSystem
    path: str

    @property
    def is_gcs(self) -> bool:
        return self.uri.startswith(f"{GCS_SCHEME}://")

    @property
    def orbax_path(self) -> str:
        """What orbax / TensorStore take: the ``gs://`` URI or the absolute local path."""
        return self.uri

    @property
    def name(self) -> str:
        """The last path component, e.g. ``prefix`` for ``gs://bucket/a/prefix``."""
        return posixpath.basename(self.path)

    def child(self, *parts: str) -> Location:
        """The location ``parts`` below this one.

        :param parts: path components, without leading slashes.
        """
        clean = [p.strip("/") for p in parts if p.strip("/")]
        return Location(
            uri=posixpath.join(self.uri, *clean),
            filesystem=self.filesystem,
            path=posixpath.join(self.path, *clean),
        )

    def sibling(self, name: str) -> Location:
        """The location next to this one called ``name`` (same parent directory or bucket prefix).

        :param name: the sibling's last path component.
        """
        parent_path = posixpath.dirname(self.path)
        if self.is_gcs and "/" not in self.path:
            raise ValueError(f"{self.uri} is a whole bucket; it has no sibling prefix")
        return Location(
            uri=posixpath.join(posixpath.dirname(self.uri), name),
            filesystem=self.filesystem,
            path=posixpath.join(parent_path, name),
        )


def resolve(uri: str) -> Location:
    """Turn a URI into a :class:`Location`.

    :param uri: ``gs://bucket/prefix``, ``file:///abs/path``, or a local path (made absolute).
        Other pyarrow schemes (``s3://``, ``hdfs://``) use pyarrow's own resolution.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"a storage URI is required, got {uri!r}")
    text = uri.strip()
    parsed = urlparse(text)
    if parsed.scheme == GCS_SCHEME:
        if not parsed.netloc:
            raise ValueError(f"{uri!r} has no bucket: write gs://BUCKET/PREFIX")
        path = posixpath.normpath(f"{parsed.netloc}/{parsed.path.strip('/')}").rstrip("/")
        if path.split("/")[0] != parsed.netloc:
            raise ValueError(f"{uri!r} leaves its bucket")
        return Location(uri=f"{GCS_SCHEME}://{path}", filesystem=gcs_filesystem(), path=path)
    if parsed.scheme in ("", "file"):
        local = parsed.path if parsed.scheme == "file" else text
        path = os.path.abspath(os.path.expanduser(local))
        return Location(uri=path, filesystem=pafs.LocalFileSystem(), path=path)
    filesystem, path = pafs.FileSystem.from_uri(text)
    return Location(uri=text.rstrip("/"), filesystem=filesystem, path=path.rstrip("/"))


def uri_for(filesystem: pafs.FileSystem, path: str) -> str:
    """The URI of ``path`` on ``filesystem`` (the inverse of :func:`resolve` for GCS and local).

    :param filesystem: a pyarrow filesystem, e.g. a Ray Train checkpoint's.
    :param path: a path inside it.
    """
    if isinstance(filesystem, pafs.GcsFileSystem):
        return f"{GCS_SCHEME}://{path.strip('/')}"
    if isinstance(filesystem, pafs.LocalFileSystem):
        return os.path.abspath(path)
    return f"{filesystem.type_name}://{path.lstrip('/')}"


def exists(uri: str) -> bool:
    """Whether anything is stored at ``uri`` (a file, or a prefix with at least one object).

    :param uri: any URI :func:`resolve` accepts.
    """
    location = resolve(uri)
    found: bool = location.filesystem.get_file_info(location.path).type != pafs.FileType.NotFound  # pyarrow: untyped
    return found


def list_files(uri: str) -> list[str]:
    """Paths (inside the filesystem) of every file under ``uri``, sorted; empty if there is none.

    :param uri: any URI :func:`resolve` accepts.
    """
    location = resolve(uri)
    selector = pafs.FileSelector(location.path, recursive=True, allow_not_found=True)
    infos = location.filesystem.get_file_info(selector)
    return sorted(info.path for info in infos if info.type == pafs.FileType.File)


def write_file(location: Location, data: bytes) -> None:
    """Write ``data`` as the file at ``location``, replacing it whole: a reader sees the old bytes or the new,
    never part (GCS objects are; a local file is written beside it as a hidden file, then renamed over it).

    :param location: where the file goes (local parent directories are made).
    :param data: its bytes.
    """
    if not isinstance(location.filesystem, pafs.LocalFileSystem):
        with location.filesystem.open_output_stream(location.path) as out:
            out.write(data)
        return
    directory, name = os.path.split(location.path)
    os.makedirs(directory, exist_ok=True)
    staged = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}")
    with open(staged, "wb") as out:
        out.write(data)
    os.replace(staged, location.path)


def delete_prefix(uri: str) -> None:
    """Delete everything under ``uri``; nothing there is fine.

    :param uri: a directory / prefix URI (a whole bucket is refused).
    """
    location = resolve(uri)
    if location.is_gcs and "/" not in location.path:
        raise ValueError(f"refusing to delete the whole bucket {location.uri}")
    fs = location.filesystem
    info = fs.get_file_info(location.path)
    if info.type == pafs.FileType.NotFound:
        return
    if info.type == pafs.FileType.File:
        fs.delete_file(location.path)
        return
    fs.delete_dir_contents(location.path, missing_dir_ok=True)
    try:
        fs.delete_dir(location.path)
    except (FileNotFoundError, OSError):
        pass  # GCS "directories" vanish with their last object
