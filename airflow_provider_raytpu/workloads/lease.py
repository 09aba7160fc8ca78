"""One writer at a time: a lease on an output, taken by a conditional create and held while renewed.

The lease is one small JSON object, ``<output>/_raytpu_lease.json``: who holds it (the task and its
run and try), the holder's staging prefix, and when it expires. Every change to it is conditional on
the version the changer read, so two writers never both believe they hold it:

- on GCS the object's generation (``if_generation_match``: 0 to create, the read generation to
  replace), as GCS documents for "request preconditions";
- on a local path a counter in the object itself, read and replaced under an exclusive ``flock`` on
  ``<output>/.raytpu-lease.lock`` (a local path is one machine, or a filesystem with POSIX locks).

A holder renews the lease every third of its time to live, from a background thread, and before each
step it must not take without it (:meth:`OutputLease.confirm`): a successful renewal means no other
writer can take the lease for another ``ttl`` seconds. A writer that finds the lease held waits,
printing who holds it; it takes the lease over only once it has expired (its holder stopped renewing:
killed, or cut off), and fails with :class:`OutputLeaseBusyError` after ``wait`` seconds. Releasing
marks the object released rather than deleting it (GCS honours preconditions on deletes, but the GCS
emulator does not, and a release must not remove another holder's lease).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import posixpath
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from airflow_provider_raytpu.workloads.storage import Location, write_file

LEASE_NAME = "_raytpu_lease.json"
LOCK_NAME = ".raytpu-lease.lock"
DEFAULT_TTL_S = 60.0
DEFAULT_WAIT_S = 900.0
PROGRESS_EVERY_S = 10.0


class OutputLeaseBusyError(Exception):
    """Another writer held an output's lease for longer than this writer would wait (retrying may succeed)."""


class LeaseLostError(Exception):
    """This writer's lease expired and another writer took it: it must stop writing the output."""


class _Conflict(Exception):
    """The lease object changed since it was read."""


@dataclass(frozen=True)
class Lease:
    """What the lease object says.

    :param holder: who holds it, e.g. ``{"dag_id", "task_id", "map_index", "run_id", "try_number"}``.
    :param token: unique to one acquisition; a holder recognises its own lease by it.
    :param staging: the URI of the holder's staging prefix (cleaned by whoever takes over).
    :param expires_at: when it expires unless renewed (seconds since the epoch).
    :param released: given back by its holder: free to take.
    """

    holder: dict[str, Any]
    token: str
    staging: str
    expires_at: float
    released: bool = False

    def free(self, now: float) -> bool:
        return self.released or self.expires_at <= now

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> Lease | None:
        try:
            return Lease.from_dict(json.loads(data))
        except ValueError:
            return None

    @staticmethod
    def from_dict(value: Any) -> Lease | None:
        try:
            return Lease(dict(value["holder"]), str(value["token"]), str(value["staging"]),
                         float(value["expires_at"]), bool(value.get("released", False)))
        except (ValueError, KeyError, TypeError):
            return None


def describe_holder(holder: dict[str, Any]) -> str:
    """``DAG etl, task clean, run scheduled__2026-12-01, try 2`` (what a waiting writer prints)."""
    parts = [f"{label} {holder[key]}" for key, label in (("dag_id", "DAG"), ("task_id", "task"),
                                                         ("run_id", "run"), ("try_number", "try")) if key in holder]
    if holder.get("map_index", -1) not in (-1, None):
        parts.append(f"map index {holder['map_index']}")
    return ", ".join(parts) or "an unnamed writer"


class _LeaseObject(Protocol):
    """The lease object's store: a read with its version, and writes conditional on one."""

    def read(self) -> tuple[Lease | None, int]: ...  # (lease, version); version 0: there is none

    def write(self, lease: Lease, version: int) -> int: ...  # the new version; raises _Conflict


class _LocalLeaseFile:
    """The lease as a local file; its version is a counter in the file, changed under an exclusive flock."""

    def __init__(self, output: Location) -> None:
        self.location = output.child(LEASE_NAME)
        self.path = self.location.path
        self.lock_path = os.path.join(output.path, LOCK_NAME)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        os.makedirs(os.path.dirname(self.lock_path), exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # closing the file releases the lock

    def _read(self) -> tuple[Lease | None, int]:
        try:
            with open(self.path, "rb") as stream:
                value = json.loads(stream.read())
        except (FileNotFoundError, ValueError):
            return None, 0
        return Lease.from_dict(value.get("lease")), int(value.get("version", 0))

    def read(self) -> tuple[Lease | None, int]:
        with self._locked():
            return self._read()

    def write(self, lease: Lease, version: int) -> int:
        with self._locked():
            if self._read()[1] != version:
                raise _Conflict(self.path)
            # Written whole, beside it as a hidden file first: a claim listing the output never sees it half-made.
            write_file(self.location, json.dumps({"lease": asdict(lease), "version": version + 1}).encode())
            return version + 1


class _GcsLeaseObject:
    """The lease as a GCS object; its version is the object's generation (google-cloud-storage preconditions)."""

    def __init__(self, output: Location) -> None:
        from google.cloud import storage

        bucket, _, prefix = output.path.partition("/")
        self.blob_name = posixpath.join(prefix, LEASE_NAME)
        self.bucket = storage.Client().bucket(bucket)

    def read(self) -> tuple[Lease | None, int]:
        blob = self.bucket.get_blob(self.blob_name)
        if blob is None:
            return None, 0
        from google.api_core.exceptions import NotFound

        try:
            data = blob.download_as_bytes(if_generation_match=blob.generation)
        except NotFound:  # replaced between the two calls: read again
            return self.read()
        return Lease.from_json(data), int(blob.generation)

    def write(self, lease: Lease, version: int) -> int:
        from google.api_core.exceptions import PreconditionFailed

        blob = self.bucket.blob(self.blob_name)
        try:
            blob.upload_from_string(lease.to_json(), content_type="application/json", if_generation_match=version)
        except PreconditionFailed as error:
            raise _Conflict(self.blob_name) from error
        return int(blob.generation)


def lease_object(output: Location) -> _LeaseObject:
    """The store for ``output``'s lease: GCS or a local path (others have no conditional writes here)."""
    if output.is_gcs:
        return _GcsLeaseObject(output)
    if output.uri.startswith("/"):
        return _LocalLeaseFile(output)
    raise ValueError(f"{output.uri}: an output must be on GCS or a local path (one writer at a time needs "
                     "conditional writes, which this provider makes there)")


class OutputLease:
    """One writer's hold on an output: :meth:`acquire`, then :meth:`confirm` before each step, :meth:`release`.

    :param output: the output prefix.
    :param holder: who is writing (shown to writers that wait).
    :param staging: the URI of this writer's staging prefix.
    :param ttl: seconds the lease lasts without renewal; a background thread renews it every ``ttl / 3``.
    :param wait: seconds to wait for another holder before :class:`OutputLeaseBusyError`.
    :param progress: receives the lines a waiting writer prints (at most every 10 s).
    """

    def __init__(self, output: Location, holder: dict[str, Any], staging: str, ttl: float = DEFAULT_TTL_S,
                 wait: float = DEFAULT_WAIT_S, progress: Callable[[str], None] = print) -> None:
        self.output = output
        self.store = lease_object(output)
        self.lease = Lease(holder, uuid.uuid4().hex, staging, 0.0)
        self.ttl = ttl
        self.wait = wait
        self.progress = progress
        self.version = 0
        self.lost: LeaseLostError | None = None
        self._lock = threading.Lock()  # the renewing thread and the writer share ``version``
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> Lease | None:
        """Take the lease, waiting while another writer holds it; the previous holder's lease (released, or
        expired: taken over), ``None`` when there was none.

        :raises OutputLeaseBusyError: still held by another writer after ``wait`` seconds.
        """
        deadline = time.monotonic() + self.wait
        next_line = time.monotonic()
        while True:
            current, version = self.store.read()
            now = time.time()
            if current is not None and current.token == self.lease.token:  # ours: a retried create that landed
                self.version = version
                return self._start_renewing(None)
            if current is None or current.free(now):
                try:
                    self._write(version)
                except _Conflict:
                    continue  # another writer changed it first: read again
                return self._start_renewing(current)
            if time.monotonic() >= deadline:
                raise OutputLeaseBusyError(
                    f"{self.output.uri} is being replaced by another writer ({describe_holder(current.holder)}); "
                    f"waited {self.wait:.0f} s for its lease. Retry the task once that writer is done, or give "
                    "each run an output prefix of its own (e.g. a templated output_uri with {{ ds }})")
            if time.monotonic() >= next_line:
                self.progress(f"Waiting to replace {self.output.uri}: {describe_holder(current.holder)} is replacing "
                              f"it (its lease expires in {max(0.0, current.expires_at - now):.0f} s unless renewed)")
                next_line = time.monotonic() + PROGRESS_EVERY_S
            time.sleep(min(1.0, self.ttl / 3) * random.uniform(0.5, 1.0))

    def _start_renewing(self, previous: Lease | None) -> Lease | None:
        self._renewer = threading.Thread(target=self._renew_loop, name="output-lease", daemon=True)
        self._renewer.start()
        return previous

    def _write(self, version: int, released: bool = False) -> None:
        self.lease = replace(self.lease, expires_at=time.time() + self.ttl, released=released)
        self.version = self.store.write(self.lease, version)

    def confirm(self) -> None:
        """Renew the lease now: from here this writer holds it for ``ttl`` seconds more.

        :raises LeaseLostError: it expired and another writer took it.
        """
        with self._lock:
            if self.lost is not None:
                raise self.lost
            try:
                self._write(self.version)
            except _Conflict:
                self.lost = LeaseLostError(
                    f"the lease on {self.output.uri} expired (not renewed for {self.ttl:.0f} s) and another writer "
                    "took it over; this writer stopped before changing the output")
                raise self.lost from None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.confirm()
            except LeaseLostError:
                return
            except Exception as error:  # a transient storage error: the next round (or confirm) tries again
                self.progress(f"Could not renew the lease on {self.output.uri}: {error}")

    def release(self) -> None:
        """Give the lease back (marked released; only if still held). A release that fails leaves the lease to
        expire: the next writer waits at most ``ttl`` seconds."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            if self.lost is not None:
                return
            try:
                self._write(self.version, released=True)
            except _Conflict:
                pass
            except Exception as error:
                self.progress(f"Could not release the lease on {self.output.uri} ({error}); it expires in "
                              f"{self.ttl:.0f} s")
