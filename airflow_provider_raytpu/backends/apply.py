"""The one way a RayCluster or RayService manifest is applied, on every backend.

:func:`apply_object` reads the object, creates it when it is missing (an "already exists"
answer means our own earlier create whose answer was lost, or a race: read again), refuses
a same-named object this provider did not make or another owner made, adopts our own with
the same spec without writing anything, and otherwise, when changing it is allowed,
replaces it (reading again when the write was stale) or recreates it (delete, wait until
gone, create). A backend provides only the store (:class:`ObjectStore`).

Ownership is what the owner annotations say (:data:`CLUSTER_OWNER`, :data:`SERVICE_OWNER`):
a RayCluster belongs to the task try's DAG run and task, so two runs or two DAGs never share
one; a RayService outlives runs (later runs promote it), so it belongs to a DAG and task.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol

from airflow_provider_raytpu.backends.base import Applied, ApplyResult, ChangedSinceChecked, Precondition
from airflow_provider_raytpu.errors import ConflictError, FatalError
from airflow_provider_raytpu.manifests.raycluster import (
    ALSO_ADOPTS_ANNOTATION,
    DAG_ID_KEY,
    DEPLOYMENT_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAP_INDEX_KEY,
    RUN_ID_KEY,
    SPEC_HASH_ANNOTATION,
    TASK_ID_KEY,
)
from airflow_provider_raytpu.progress import LogPace

log = logging.getLogger(__name__)

APPLY_ATTEMPTS = 5
GONE_TIMEOUT = 600.0
GONE_POLL_SECONDS = 1.0
CLUSTER_OWNER = (DEPLOYMENT_KEY, DAG_ID_KEY, RUN_ID_KEY, TASK_ID_KEY, MAP_INDEX_KEY)
"""A RayCluster belongs to one DAG run's task (every try of it; one map index of a mapped task) in one Airflow
deployment."""
SERVICE_OWNER = (DEPLOYMENT_KEY, DAG_ID_KEY, TASK_ID_KEY, MAP_INDEX_KEY)
"""A RayService belongs to one DAG's task (one map index of a mapped task) in one Airflow deployment: later runs
of that task promote it."""


class OnChange(str, Enum):
    """What applying does with our own object whose spec differs from the manifest's."""

    FAIL = "fail"
    REPLACE = "replace"
    RECREATE = "recreate"


class AlreadyExists(Exception):
    """A create found an object of that name."""


class StaleWrite(Exception):
    """A replace carried an outdated ``resourceVersion``: the object changed since it was read."""


class ObjectStore(Protocol):
    """Where one kind of object lives, as :func:`apply_object` needs it. A store that only creates, or never
    recreates, subclasses it and leaves out the method its :class:`OnChange` does not use."""

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The stored object, or ``None``."""

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store a new object; :class:`AlreadyExists` when one has that name."""

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Replace the stored object; :class:`StaleWrite` when it changed since it was read.

        Needed only with :attr:`OnChange.REPLACE`."""
        raise TypeError(f"{type(self).__name__} does not replace objects: apply it with another OnChange")

    def delete(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        """Delete the object if it is the checked one (:class:`ChangedSinceChecked` if not); ``False`` when it
        was already gone. Needed only with :attr:`OnChange.RECREATE`."""
        raise TypeError(f"{type(self).__name__} does not delete objects: apply it with another OnChange")


def wait_until_gone(kind: str, name: str, namespace: str, get: Callable[[str, str], Any],
                    timeout: float = GONE_TIMEOUT, poll_interval: float = GONE_POLL_SECONDS, log: Any = log,
                    pods_left: Callable[[], list[str]] | None = None, deleting_since: float | None = None) -> None:
    """Poll until the object, and the pods it had (``pods_left``), are gone; log what is left on every change
    and at least every :data:`~airflow_provider_raytpu.progress.PROGRESS_SECONDS`; or fail naming
    what to check. The last line says how long the deletion took, from ``deleting_since``
    (``time.monotonic()`` when the delete call began; default: now)."""
    pace = LogPace()
    since = pace.started if deleting_since is None else deleting_since
    while True:
        exists = get(name, namespace) is not None
        pods = pods_left() if pods_left is not None and not exists else []
        if not exists and not pods:
            log.info("%s %s/%s %s after %.0f s", kind, namespace, name,
                     "and its pods are gone" if pods_left is not None else "is gone", time.monotonic() - since)
            return
        left = f"the {kind} is being deleted" if exists else f"the {kind} is gone"
        if pods:
            shown = ", ".join(sorted(pods)[:5]) + (f" and {len(pods) - 5} more" if len(pods) > 5 else "")
            left += f"; {len(pods)} {'pod' if len(pods) == 1 else 'pods'} terminating ({shown})"
        if pace.due(left):
            log.info("Waiting for %s %s/%s to be gone: %s (%.0f s)", kind, namespace, name, left, pace.elapsed)
        if pace.elapsed > timeout:
            pod_hint = f", and kubectl get pods -n {namespace} -l ray.io/cluster={name}" if pods_left else ""
            raise TimeoutError(
                f"{kind} {namespace}/{name} not gone {timeout:.0f} s after delete ({left}); check for stuck "
                f"finalizers with kubectl get {kind.lower()} {name} -n {namespace} -o yaml{pod_hint}"
            )
        time.sleep(min(poll_interval, pace.seconds_left()))


def annotations_of(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def is_managed(obj: dict[str, Any]) -> bool:
    """Whether this provider made the object (its ``managed-by`` label)."""
    return (obj.get("metadata", {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY


def same_spec(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing resource is the one ``manifest`` renders: its spec hash is the manifest's, or one
    an older release gave the same spec (``raytpu.dev/also-adopts``, so a retry after an upgrade adopts it)."""
    mine = annotations_of(manifest)
    older = json.loads(mine.get(ALSO_ADOPTS_ANNOTATION) or "[]")
    return annotations_of(existing).get(SPEC_HASH_ANNOTATION) in (mine[SPEC_HASH_ANNOTATION], *older)


def same_service(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing RayService is the one ``manifest`` renders: same spec hash and same model version."""
    from airflow_provider_raytpu.manifests.rayservice import service_version

    return same_spec(existing, manifest) and service_version(existing) == service_version(manifest)


def owner_of(obj: dict[str, Any], keys: Sequence[str]) -> tuple[str | None, ...]:
    """The owner an object's annotations record, as the values of ``keys`` (``None`` where absent)."""
    notes = annotations_of(obj)
    return tuple(notes.get(key) for key in keys)


def describe_owner(obj: dict[str, Any]) -> str:
    """``DAG 'x', run 'y', task 'z'`` (``, map index 1`` for a mapped task; ``, deployment 'd'``) as an object's
    annotations record them."""
    notes = annotations_of(obj)
    if DAG_ID_KEY not in notes:
        return "no Airflow task (no owner annotations)"
    mapped = f", map index {notes[MAP_INDEX_KEY]}" if MAP_INDEX_KEY in notes else ""
    deployed = f", deployment {notes[DEPLOYMENT_KEY]!r}" if DEPLOYMENT_KEY in notes else ""
    return (f"DAG {notes[DAG_ID_KEY]!r}, run {notes.get(RUN_ID_KEY)!r}, task {notes.get(TASK_ID_KEY)!r}{mapped}"
            f"{deployed}")


def owner_error(existing: dict[str, Any], manifest: dict[str, Any],
                owner: Sequence[str] = CLUSTER_OWNER) -> ConflictError:
    """The error for a same-named object another deployment, DAG, run or task made: never adopted, updated or
    deleted.

    :param owner: the owner annotations compared (:data:`CLUSTER_OWNER`, :data:`SERVICE_OWNER`).
    """
    kind = manifest.get("kind") or existing.get("kind") or "object"
    metadata = manifest["metadata"]
    mine, theirs = annotations_of(manifest), annotations_of(existing)
    same_task = all(mine.get(key) == theirs.get(key) for key in owner if key != DEPLOYMENT_KEY)
    if same_task and DEPLOYMENT_KEY not in theirs:
        fix = (f"It was made before this provider recorded the Airflow deployment. If it is this deployment's, "
               f"record that: kubectl annotate -n {metadata['namespace']} {kind.lower()}s {metadata['name']} "
               f"{DEPLOYMENT_KEY}={mine.get(DEPLOYMENT_KEY)}")
    elif same_task:
        fix = ("The same DAG and task in another Airflow deployment made it (the deployments share DAG ids and this "
               "namespace): give each deployment's raytpu connection its own extra.deployment, or its own namespace.")
    elif mine.get(MAP_INDEX_KEY) != theirs.get(MAP_INDEX_KEY) and all(
            mine.get(key) == theirs.get(key) for key in (DAG_ID_KEY, TASK_ID_KEY)):
        fix = ("Two map indexes of one mapped task resolve to this name: leave the name unset (each map index "
               "gets its own), or make it differ per map index, e.g. with {{ ti.map_index }}.")
    else:
        fix = (f"Leave the name unset for a name of this task's own, choose another name, or delete the existing "
               f"{kind} first.")
    return ConflictError(
        f"{kind} {metadata['name']!r} in namespace {metadata['namespace']!r} belongs to {describe_owner(existing)}, "
        f"not to this task ({describe_owner(manifest)}), so it is not adopted, updated or deleted. {fix}"
    )


def conflict_error(existing: dict[str, Any], manifest: dict[str, Any]) -> ConflictError:
    """The error for an existing resource of the same name whose spec differs."""
    metadata = existing.get("metadata", {})
    kind = existing.get("kind", "RayCluster")
    notes = annotations_of(existing)
    made_by = f"made by {describe_owner(existing)}" if DAG_ID_KEY in notes else "not made by this provider"
    return ConflictError(
        f"{kind} {metadata.get('name')!r} in namespace {metadata.get('namespace')!r} already exists with a "
        f"different spec (spec hash {notes.get(SPEC_HASH_ANNOTATION)!r}, this task renders "
        f"{annotations_of(manifest)[SPEC_HASH_ANNOTATION]!r}; {made_by}). Choose another name, delete "
        f"the existing {kind}, or set update_if_exists=True to recreate it with this spec."
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


def check_owner(existing: dict[str, Any], manifest: dict[str, Any], owner: Sequence[str]) -> None:
    """Refuse to act on ``existing`` unless this provider made it for the owner ``manifest`` records.

    :param owner: the owner annotations that must be equal (:data:`CLUSTER_OWNER`, :data:`SERVICE_OWNER`).
    :raises ConflictError: another owner's object, or one this provider did not make.
    """
    if not is_managed(existing):
        raise foreign_error(existing, manifest)
    if owner_of(existing, owner) != owner_of(manifest, owner):
        raise owner_error(existing, manifest, owner)


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


def apply_object(store: ObjectStore, manifest: dict[str, Any], *,
                 same: Callable[[dict[str, Any], dict[str, Any]], bool], owner: Sequence[str], on_change: OnChange,
                 attempts: int = APPLY_ATTEMPTS, gone_timeout: float = GONE_TIMEOUT,
                 poll_interval: float = GONE_POLL_SECONDS) -> ApplyResult:
    """Create the object, adopt our own same one, or change our own different one if allowed.

    :param store: where objects of the manifest's kind live.
    :param manifest: the rendered object (with this provider's labels, owner and spec-hash annotations); one
        made from a stored object carries its ``metadata.uid`` and changes only that object.
    :param same: whether a stored object is the one ``manifest`` renders (then nothing is written).
    :param owner: the owner annotations that must be equal on the stored object and the manifest
        (:data:`CLUSTER_OWNER`, :data:`SERVICE_OWNER`).
    :param on_change: replace or recreate our own different object, or refuse it.
    :param attempts: how many times to read again after a lost create or a stale write.
    :param gone_timeout: how long to wait for a deleted object to be gone before creating it again.
    :param poll_interval: seconds between reads while waiting for that.
    :raises ConflictError: a same-named object this provider did not make, or another owner made,
        or a different one of our own with ``on_change`` :attr:`OnChange.FAIL`.
    :raises ChangedSinceChecked: the object a manifest with a uid was made from is gone or replaced.
    """
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    kind = manifest.get("kind", "object")
    action = Applied.CREATED
    for _ in range(attempts):
        existing = store.get(name, namespace)
        if existing is not None and existing.get("metadata", {}).get("deletionTimestamp"):
            log.info("%s %s/%s is being deleted; waiting until it is gone to create it again", kind, namespace, name)
            wait_until_gone(kind, name, namespace, store.get, gone_timeout, poll_interval)
            existing = None
        if (checked := manifest["metadata"].get("uid")) and (existing or {}).get("metadata", {}).get("uid") != checked:
            # A manifest made from a stored object (a rollback) changes only that object, never a successor.
            raise ChangedSinceChecked(kind, name, namespace, f"made from uid {checked}", "not changed")
        if existing is None:
            try:
                return ApplyResult(action, store.create(manifest))
            except AlreadyExists:
                log.info("%s %s/%s exists already (an earlier create whose answer was lost?); reading it",
                         kind, namespace, name)
                continue
        check_owner(existing, manifest, owner)
        if same(existing, manifest):
            return ApplyResult(Applied.ADOPTED, existing)
        if on_change is OnChange.FAIL:
            raise conflict_error(existing, manifest)
        if on_change is OnChange.RECREATE:
            # A RayCluster's pods do not follow a new spec (KubeRay v1.5 has no RayCluster
            # upgradeStrategy): only a new cluster runs the new head and slices.
            log.info("%s %s/%s has another spec (hash %s, wanted %s): deleting it, waiting until it is gone, "
                     "creating it again", kind, namespace, name, annotations_of(existing).get(SPEC_HASH_ANNOTATION),
                     annotations_of(manifest)[SPEC_HASH_ANNOTATION])
            try:
                store.delete(name, namespace, Precondition.of(existing))
            except ChangedSinceChecked as exc:
                log.info("%s; reading it again", exc)  # replaced since the owner check: check the new one
                continue
            wait_until_gone(kind, name, namespace, store.get, gone_timeout, poll_interval)
            action = Applied.RECREATED
            continue
        try:
            return ApplyResult(Applied.UPDATED, store.replace(replacement(existing, manifest)))
        except StaleWrite:
            # The operator wrote the status since we read it (stale resourceVersion): read again.
            log.info("%s %s/%s changed while being updated; reading it again", kind, namespace, name)
    raise FatalError(f"{kind} {namespace}/{name} kept changing while being applied ({attempts} attempts)")
