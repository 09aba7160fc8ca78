"""The one way a RayCluster or RayService manifest is applied, on every backend.

:func:`apply_object` reads the object, creates it when it is missing (an "already exists"
answer means our own earlier create whose answer was lost, or a race: read again), refuses
a same-named object this provider did not make, adopts one with the same spec without
writing anything, and otherwise replaces it when updating is allowed, reading again when
the write was stale. A backend provides only the store (:class:`ObjectStore`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from airflow_provider_raytpu.backends.base import Applied, ApplyResult
from airflow_provider_raytpu.errors import ConflictError, FatalError
from airflow_provider_raytpu.manifests.raycluster import (
    DAG_ID_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RUN_ID_KEY,
    SPEC_HASH_ANNOTATION,
    TASK_ID_KEY,
)

log = logging.getLogger(__name__)

APPLY_ATTEMPTS = 5


class AlreadyExists(Exception):
    """A create found an object of that name."""


class StaleWrite(Exception):
    """A replace carried an outdated ``resourceVersion``: the object changed since it was read."""


class ObjectStore(Protocol):
    """Where one kind of object lives, as :func:`apply_object` needs it."""

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The stored object, or ``None``."""

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store a new object; :class:`AlreadyExists` when one has that name."""

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Replace the stored object; :class:`StaleWrite` when it changed since it was read."""


def annotations_of(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def is_managed(obj: dict[str, Any]) -> bool:
    """Whether this provider made the object (its ``managed-by`` label)."""
    return (obj.get("metadata", {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY


def same_spec(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing resource is the one ``manifest`` renders (equal spec-hash annotations)."""
    return annotations_of(existing).get(SPEC_HASH_ANNOTATION) == annotations_of(manifest)[SPEC_HASH_ANNOTATION]


def same_service(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing RayService is the one ``manifest`` renders: same spec hash and same model version."""
    from airflow_provider_raytpu.manifests.rayservice import service_version

    return same_spec(existing, manifest) and service_version(existing) == service_version(manifest)


def conflict_error(existing: dict[str, Any], manifest: dict[str, Any]) -> ConflictError:
    """The error for an existing resource of the same name whose spec differs."""
    metadata = existing.get("metadata", {})
    kind = existing.get("kind", "RayCluster")
    notes = annotations_of(existing)
    made_by = (
        f"made by DAG {notes[DAG_ID_KEY]!r}, run {notes.get(RUN_ID_KEY)!r}, task {notes.get(TASK_ID_KEY)!r}"
        if DAG_ID_KEY in notes
        else "not made by this provider"
    )
    return ConflictError(
        f"{kind} {metadata.get('name')!r} in namespace {metadata.get('namespace')!r} already exists with a "
        f"different spec (spec hash {notes.get(SPEC_HASH_ANNOTATION)!r}, this task renders "
        f"{annotations_of(manifest)[SPEC_HASH_ANNOTATION]!r}; {made_by}). Choose another name, delete "
        f"the existing {kind}, or set update_if_exists=True to update it in place."
    )


def foreign_error(existing: dict[str, Any], manifest: dict[str, Any]) -> ConflictError:
    """The error for a same-named object this provider did not make: it is never adopted, updated or replaced."""
    metadata = manifest["metadata"]
    kind = manifest.get("kind") or existing.get("kind") or "object"
    return ConflictError(
        f"{kind} {metadata['name']!r} in namespace {metadata['namespace']!r} already exists and was not "
        f"made by this provider (no {MANAGED_BY_LABEL}={MANAGED_BY} label), so it is not adopted or replaced. "
        f"Choose another name, or delete the existing {kind}."
    )


def replacement(existing: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as a replacement of ``existing``: the stored metadata (uid, resourceVersion, ...) with
    the manifest's labels and annotations merged over the stored ones."""
    old = existing["metadata"]
    return {
        **manifest,
        "metadata": {
            **old,
            "labels": {**(old.get("labels") or {}), **manifest["metadata"]["labels"]},
            "annotations": {**(old.get("annotations") or {}), **manifest["metadata"]["annotations"]},
        },
    }


def apply_object(store: ObjectStore, manifest: dict[str, Any], *, same: Callable[[dict[str, Any], dict[str, Any]], bool],
                 update: bool, attempts: int = APPLY_ATTEMPTS) -> ApplyResult:
    """Create the object, adopt the same one, or update a different one if allowed.

    :param store: where objects of the manifest's kind live.
    :param manifest: the rendered object (with this provider's labels and spec-hash annotation).
    :param same: whether a stored object is the one ``manifest`` renders (then nothing is written).
    :param update: replace a different one (else it is a conflict).
    :param attempts: how many times to read again after a lost create or a stale write.
    :raises ConflictError: a same-named object this provider did not make, or a different one
        and ``update`` is false.
    """
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    kind = manifest.get("kind", "object")
    for _ in range(attempts):
        existing = store.get(name, namespace)
        if existing is None:
            try:
                return ApplyResult(Applied.CREATED, store.create(manifest))
            except AlreadyExists:
                log.info("%s %s/%s exists already (an earlier create whose answer was lost?); reading it",
                         kind, namespace, name)
                continue
        if not is_managed(existing):
            raise foreign_error(existing, manifest)
        if same(existing, manifest):
            return ApplyResult(Applied.ADOPTED, existing)
        if not update:
            raise conflict_error(existing, manifest)
        try:
            return ApplyResult(Applied.UPDATED, store.replace(replacement(existing, manifest)))
        except StaleWrite:
            # The operator wrote the status since we read it (stale resourceVersion): read again.
            log.info("%s %s/%s changed while being updated; reading it again", kind, namespace, name)
    raise FatalError(f"{kind} {namespace}/{name} kept changing while being applied ({attempts} attempts)")
