"""A job's local ``working_dir`` and ``py_modules``, packaged and uploaded to its cluster the way Ray's client does.

Ray's job client (Ray 2.60 ``dashboard/modules/dashboard_sdk.py``: ``_upload_working_dir_if_needed``,
``_upload_py_modules_if_needed``, ``_upload_package_if_needed``) replaces each local path of a
runtime_env by a content-addressed ``gcs://`` URI, asks the dashboard whether it holds that package
(``GET /api/packages/gcs/<name>``: 200 or 404) and uploads the zip when not (``PUT``, the zip as
body). This module does the same without importing Ray, so the cluster unpacks exactly what Ray's
client would have sent, under the same name (``tests/unit/test_job_packages.py`` compares both):

- the URI of a directory is ``gcs://_ray_pkg_<hash>.zip``, the hash the XOR of the SHA-1 of each
  path (relative to the directory; a file's content after it) folded into 8 bytes, starting from
  ``b"0" * 8`` (``packaging.py``: ``_hash_directory``); a ``.py`` file's hash is its own (``_hash_file``);
- a walk skips what ``excludes`` (gitignore patterns, relative to the package), a ``.gitignore``
  (unless ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``) and a ``.rayignore`` of any directory match, the
  latter two relative to their directory (``_dir_travel``, ``get_excludes_from_ignore_files``);
- a ``working_dir`` also leaves out ``.git``, ``.venv``, ``venv`` and ``__pycache__``
  (``RAY_RUNTIME_ENV_DEFAULT_EXCLUDES``, overridden by ``RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES``);
- the zip holds each file and empty directory under its path, below the directory's own name for a
  ``py_modules`` entry (``include_parent_dir``), stored uncompressed (``_zip_files``);
- a wheel (``py_modules``) or an archive (``working_dir``) goes as it is, named by its file name
  (a wheel) or the SHA-1 of its bytes (``get_uri_for_package``); a URI is passed through.

A local pip requirements file, or conda YAML file, is read here too, as Ray's ``RuntimeEnv``
validation does on the client (``_private/runtime_env/validation.py``).
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
import os
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from airflow_provider_raytpu.dashboard.transport import UPLOAD_TIMEOUT_SECONDS

if TYPE_CHECKING:
    from airflow_provider_raytpu.dashboard.transport import HttpAnswer

log = logging.getLogger(__name__)

PACKAGE_PREFIX = "_ray_pkg_"
DEFAULT_EXCLUDES = ".git,.venv,venv,__pycache__"
#: Archive endings Ray takes as a ``working_dir`` file, and the ending of its URI (``get_uri_for_package``).
ARCHIVE_ENDINGS = {".zip": ".zip", ".jar": ".zip", ".tar.gz": ".tar.gz", ".tgz": ".tar.gz", ".tar.xz": ".tar.xz"}

Exclude = Callable[[Path], bool]


class PackageStore(Protocol):
    """Where packages go: the cluster's Jobs API (:class:`~airflow_provider_raytpu.dashboard.jobs.JobsApi`)."""

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                timeout: float | None = None) -> HttpAnswer: ...

    def refused(self, answer: HttpAnswer) -> RuntimeError: ...


def upload_local_packages(runtime_env: Mapping[str, Any], jobs: PackageStore) -> dict[str, Any]:
    """``runtime_env`` with each local ``working_dir`` / ``py_modules`` path replaced by the URI of the package
    the cluster now holds, and a local pip requirements or conda YAML file by its content.

    :param runtime_env: the job's runtime_env as the task has it.
    :param jobs: the cluster's Jobs API (the packages go to its dashboard).
    """
    env = copy.deepcopy(dict(runtime_env))
    excludes = list(env.get("excludes") or [])
    if isinstance(env.get("working_dir"), (str, Path)) and not is_uri(str(env["working_dir"])):
        default = os.environ.get("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", DEFAULT_EXCLUDES)
        working_excludes = [x.strip() for x in default.split(",") if x.strip()] + excludes
        env["working_dir"] = upload(Path(env["working_dir"]), jobs, working_excludes, in_parent_dir=False)
    if isinstance(env.get("py_modules"), list):
        env["py_modules"] = [module if is_uri(str(module)) else upload(Path(module), jobs, excludes, in_parent_dir=True)
                             for module in env["py_modules"]]
    if isinstance(env.get("pip"), str):
        env["pip"] = requirements(Path(env["pip"]))
    conda = env.get("conda")
    if isinstance(conda, str) and Path(conda).suffix in (".yaml", ".yml"):
        import yaml

        env["conda"] = yaml.safe_load(Path(conda).read_text())
    return env


def is_uri(path: str) -> bool:
    """Whether a runtime_env path is a URI (``gcs://...``, ``gs://...``, ``https://...``) rather than a local path."""
    return "://" in path


def upload(path: Path, jobs: PackageStore, excludes: list[str], *, in_parent_dir: bool) -> str:
    """Upload the package of ``path`` unless the cluster holds it already; its URI.

    :param in_parent_dir: zip a directory below its own name (``py_modules``), not at the top (``working_dir``).
    :raises ValueError: ``path`` is neither a directory nor a file Ray takes there.
    """
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    make: Callable[[], bytes]
    if path.is_dir():
        uri = PACKAGE_PREFIX + hash_walk(path, excludes, include_gitignore).hex() + ".zip"
        make = partial(zip_walk, path, excludes, include_gitignore, in_parent_dir)
    elif path.is_file() and in_parent_dir and path.suffix == ".py":
        uri = PACKAGE_PREFIX + xor(entry_hash(path, path.parent), b"0" * 8).hex() + ".zip"
        make = partial(zip_walk, path, excludes, include_gitignore, False)
    elif path.is_file() and in_parent_dir and path.suffix == ".whl":
        uri, make = path.name, path.read_bytes
    elif path.is_file() and not in_parent_dir and (ending := archive_ending(path.name)):
        archive = path.read_bytes()
        uri, make = PACKAGE_PREFIX + hashlib.sha1(archive).hexdigest() + ending, lambda: archive
    else:
        field, takes = (("py_modules", "a directory, a .py file or a .whl file") if in_parent_dir else
                        ("working_dir", f"a directory or an archive ({', '.join(ARCHIVE_ENDINGS)})"))
        raise ValueError(f"runtime_env {field}={str(path)!r}: not {takes} on this machine; give a local path "
                         "there, or the URI of a package the cluster can fetch (gs://..., https://...)")
    endpoint = f"/api/packages/gcs/{uri}"
    held = jobs.request("GET", endpoint)
    if held.status == 200:
        log.info("Package gcs://%s already exists, skipping upload.", uri)
    elif held.status == 404:
        package = make()
        log.info("Uploading package gcs://%s (%s, %.1f MiB).", uri, path, len(package) / 2**20)
        stored = jobs.request("PUT", endpoint, data=package, timeout=UPLOAD_TIMEOUT_SECONDS)
        if stored.status != 200:
            raise jobs.refused(stored)
    else:
        raise jobs.refused(held)
    return f"gcs://{uri}"


def archive_ending(name: str) -> str | None:
    return next((uri_ending for ending, uri_ending in ARCHIVE_ENDINGS.items() if name.endswith(ending)), None)


def requirements(path: Path) -> list[str]:
    """The requirements of a local pip requirements file, one a line (Ray's ``_handle_local_deps_requirement_file``;
    blank lines left out)."""
    if not path.is_file():
        raise ValueError(f"runtime_env pip={str(path)!r}: no such requirements file on this machine; give a list of "
                         "requirements, or the path of a file that exists where the task runs")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def xor(left: bytes, right: bytes) -> bytes:
    """Ray's ``_xor_bytes``: byte-wise XOR, as long as the shorter (the running hash keeps 8 bytes)."""
    return bytes(a ^ b for a, b in zip(left, right, strict=False))


def entry_hash(path: Path, root: Path) -> bytes:
    """SHA-1 of the path relative to ``root`` and, for a file, of its content
    (``_hash_file_content_or_directory_name``)."""
    sha1 = hashlib.sha1(str(path.relative_to(root)).encode())
    if not path.is_dir():
        with path.open("rb") as content:
            for block in iter(lambda: content.read(4 << 20), b""):
                sha1.update(block)
    return sha1.digest()


def gitignore_matcher(lines: list[str], base: Path) -> Exclude:
    """Whether a path matches gitignore ``lines``, relative to ``base`` (Ray's ``_get_excludes``)."""
    import pathspec

    with warnings.catch_warnings(action="ignore", category=DeprecationWarning):  # pathspec 1 renamed it; Ray uses it
        spec = pathspec.PathSpec.from_lines("gitwildmatch", lines)
    base = base.absolute()
    return lambda p: spec.match_file(str(p.absolute().relative_to(base)))


def ignore_files(directory: Path, include_gitignore: bool) -> list[Exclude]:
    """The ``.gitignore`` and ``.rayignore`` of ``directory`` as matchers (``get_excludes_from_ignore_files``)."""
    names = [".gitignore", ".rayignore"] if include_gitignore else [".rayignore"]
    found = [directory / name for name in names if (directory / name).is_file()]
    return [gitignore_matcher(file.read_text().splitlines(keepends=True), directory) for file in found]


def walk(path: Path, excludes: list[Exclude], include_gitignore: bool) -> Iterator[Path]:
    """``path`` and, for a directory, everything below it that no exclude (nor an ignore file on the way) matches,
    in Ray's ``_dir_travel`` order."""
    excludes = excludes + ignore_files(path, include_gitignore)
    if any(exclude(path) for exclude in excludes):
        return
    yield path
    if path.is_dir():
        for sub in path.iterdir():
            yield from walk(sub, excludes, include_gitignore)


def hash_walk(path: Path, excludes: list[str], include_gitignore: bool) -> bytes:
    """The 8-byte content hash of a directory (``_hash_directory``)."""
    value = b"0" * 8
    for entry in walk(path, [gitignore_matcher(excludes, path)], include_gitignore):
        value = xor(value, entry_hash(entry, path))
    return value


def zip_walk(path: Path, excludes: list[str], include_gitignore: bool, in_parent_dir: bool) -> bytes:
    """The zip Ray's ``_zip_files`` makes of ``path``: its files and empty directories."""
    top = path.absolute() if path.is_dir() else path.absolute().parent
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", strict_timestamps=False) as archive:
        for entry in walk(path.absolute(), [gitignore_matcher(excludes, path)], include_gitignore):
            if entry.is_file() or (entry.is_dir() and next(entry.iterdir(), None) is None):
                name = entry.relative_to(top)
                archive.write(entry, Path(top.name) / name if in_parent_dir else name)
    return buffer.getvalue()
