"""What the RayCluster and RayService delete operators share: by name, or by owner when no name is given.

A teardown must not depend on its setup's success or XCom: when a create task applied its
object and then failed (a lost answer, a timeout), Airflow would skip a teardown whose
setups all failed, its XCom is missing and a templated name cannot render, yet the object
runs on. So as a teardown it runs once everything upstream is done, whatever happened
(``all_done``), and without a name :class:`DeleteOwnedOperator` lists this provider's
objects whose owner labels say this DAG (and, for a RayCluster, this run) made them, keeps
those whose owner annotations name one of the creating tasks exactly, and deletes them.
The creating tasks are ``created_by``, else the creating operators upstream of the teardown.

A name given explicitly is held to the same owners: two overlapping runs of a DAG with a
literal ``cluster_name`` share the name, and run 2's teardown must not delete run 1's
cluster mid-training. An object of another owner (or not made by this provider) is left
alone with a warning naming its owner, unless ``force=True``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator

from airflow_provider_raytpu.backends.apply import describe_owner, is_managed, owner_of, wait_until_gone
from airflow_provider_raytpu.backends.base import ChangedSinceChecked, Precondition
from airflow_provider_raytpu.manifests.names import label_value
from airflow_provider_raytpu.manifests.raycluster import (
    DAG_ID_KEY,
    DEPLOYMENT_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAP_INDEX_KEY,
    RUN_ID_KEY,
    TASK_ID_KEY,
)
from airflow_provider_raytpu.progress import progress
from airflow_provider_raytpu.tasks.base import (
    ClusterTaskMixin,
    TeardownWhateverHappenedMixin,
    fail_fast,
    map_index_of,
)
from airflow_provider_raytpu.values import duration_seconds

if TYPE_CHECKING:
    from airflow.sdk import Context


#: What deleting one checked object did.
DELETED, GONE, CHANGED = "deleted", "was already gone", "changed"


class DeleteOwnedOperator(TeardownWhateverHappenedMixin, ClusterTaskMixin, BaseOperator):
    """Delete one named object, or every object the creating tasks of this DAG (run) made.

    Subclasses say which kind (:attr:`kind`), which owner keys select (:attr:`owner_keys`), the
    name's length limit, which operators create it (:meth:`creates`) and how the backend
    gets, deletes and lists it.

    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param created_by: delete what these task ids made; default: the task ids of the creating
        operators upstream of this task, else every task of the DAG.
    :param force: delete a named object even when another DAG, run or task made it, or this
        provider did not make it; without it such an object is left alone with a warning naming its owner.
    :param wait_for_deletion: wait until each deleted object (and its pods, where the kind has them) is gone;
        the log says what is left at least every 10 s.
    :param deletion_timeout: how long to wait for that (a ``timedelta`` or seconds).
    :param poll_interval: how long between checks while waiting.
    """

    kind: ClassVar[str]
    owner_keys: ClassVar[tuple[str, ...]]
    other_selectors: ClassVar[tuple[str, ...]] = ()
    deletes_also: ClassVar[str] = ""
    """What deleting one object also takes down, for the progress line (e.g. ``" and its clusters"``)."""
    ui_color = "#fde8e8"

    def __init__(self, *, namespace: str | None = None, raytpu_conn_id: str | None = None,
                 created_by: str | Sequence[str] | None = None, wait_for_deletion: bool = False,
                 deletion_timeout: timedelta | float = 600, poll_interval: timedelta | float = 2, force: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.force = force
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.created_by = created_by
        self.wait_for_deletion = wait_for_deletion
        self.deletion_timeout = duration_seconds(deletion_timeout, "deletion_timeout", example="600")
        self.poll_interval = duration_seconds(poll_interval, "poll_interval", example="2")

    # -- what a subclass provides -------------------------------------------------------------

    def creates(self, task: Any) -> bool:
        """Whether an upstream task is an operator that creates this kind."""
        raise NotImplementedError

    def get_object(self, name: str, namespace: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def delete_object(self, name: str, namespace: str, precondition: Precondition) -> bool:
        raise NotImplementedError

    def list_objects(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    #: How far the deletion of one object is, for the progress line while the delete call blocks.
    deletion_detail: Callable[[str, str], str] | None = None
    #: The pods an object had that are still there: the wait ends once they are gone too.
    pods_left: Callable[[str, str], list[str]] | None = None

    # -- shared -------------------------------------------------------------------------------

    def creating_tasks(self) -> list[str]:
        """``created_by``, else the creating operators upstream of this task (empty: any task)."""
        if self.created_by:
            return [self.created_by] if isinstance(self.created_by, str) else list(self.created_by)
        return sorted(task.task_id for task in self.get_flat_relatives(upstream=True) if self.creates(task))

    def wanted_owner(self, context: Context) -> dict[str, str]:
        """The owner annotations an object of this DAG (run) in this deployment has, for the keys this kind records.

        A mapped delete task takes only what the same map index made; an unmapped one, every map index.
        """
        ti = context["ti"]
        wanted = {DEPLOYMENT_KEY: self.hook.deployment, DAG_ID_KEY: ti.dag_id, RUN_ID_KEY: ti.run_id}
        if (map_index := map_index_of(context)) >= 0:
            wanted[MAP_INDEX_KEY] = str(map_index)
        return {key: value for key, value in wanted.items() if key in self.owner_keys}

    def made_here(self, obj: dict[str, Any], wanted: dict[str, str], tasks: Sequence[str]) -> bool:
        """Whether this provider made ``obj`` for this DAG (run) in one of ``tasks`` (any task when empty)."""
        recorded = dict(zip(self.owner_keys, owner_of(obj, self.owner_keys), strict=True))
        return is_managed(obj) and all(recorded[key] == value for key, value in wanted.items()) and (
            not tasks or recorded.get(TASK_ID_KEY) in tasks)

    def owned(self, context: Context, namespace: str) -> dict[str, Precondition | None]:
        """The objects in ``namespace`` the creating tasks of this DAG (run) made, by name, as checked."""
        wanted = self.wanted_owner(context)
        selector = [f"{MANAGED_BY_LABEL}={MANAGED_BY}", *self.other_selectors]
        selector += [f"{key}={label_value(value)}" for key, value in wanted.items() if key != MAP_INDEX_KEY]
        tasks = self.creating_tasks()
        found: dict[str, Precondition | None] = {
            obj["metadata"]["name"]: Precondition.of(obj) for obj in self.list_objects(namespace, ",".join(selector))
            if self.made_here(obj, wanted, tasks)}
        where = f"made by task(s) {', '.join(tasks)}" if tasks else "made by any task"
        scope = "this DAG run" if RUN_ID_KEY in self.owner_keys else "this DAG"
        self.log.info("No %s name given: %d %s(s) of %s %s in namespace %s: %s", self.kind, len(found), self.kind,
                      scope, where, namespace, ", ".join(found) or "none")
        return found

    def named(self, context: Context, target: str, namespace: str) -> dict[str, Precondition | None]:
        """``target`` as checked (``None``: it is gone) when this DAG (run)'s creating tasks made it, or ``force``;
        else nothing, with a warning."""
        obj = self.get_object(target, namespace)
        tasks = self.creating_tasks()
        if obj is None or self.force or self.made_here(obj, self.wanted_owner(context), tasks):
            return {target: Precondition.of(obj) if obj is not None else None}
        owner = describe_owner(obj) if is_managed(obj) else "no task of this provider (it has no managed-by label)"
        scope = "this DAG run" if RUN_ID_KEY in self.owner_keys else "this DAG"
        made_by = f"task(s) {', '.join(tasks)} of {scope}" if tasks else f"a task of {scope}"
        self.log.warning(
            "Not deleting %s %s/%s: it belongs to %s, not to %s. It may still be in use; pass force=True to "
            "delete it anyway", self.kind, namespace, target, owner, made_by)
        return {}

    def delete_checked(self, target: str, namespace: str, precondition: Precondition | None) -> str:
        """Delete the object as it was checked (``None``: it was gone then): ``deleted``, ``was already gone``,
        or ``changed`` with a warning when it is not the checked object any more (nothing is deleted)."""
        if precondition is None:
            return GONE
        detail = self.deletion_detail
        try:
            with progress(self.log, f"Deleting {self.kind} {namespace}/{target}{self.deletes_also}",
                          partial(detail, target, namespace) if detail is not None else None):
                return DELETED if self.delete_object(target, namespace, precondition) else GONE
        except ChangedSinceChecked as exc:
            self.log.warning("%s. It was replaced or changed after its owner was checked, so it is left alone: "
                             "check who made it before deleting it", exc)
            return CHANGED

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            namespace = self.resolved_namespace()
            name = self.resolved_name() if getattr(self, self.reference_name) else None
            checked = self.named(context, name, namespace) if name else self.owned(context, namespace)
            skipped = [name] if name and not checked else []
            deleted: dict[str, float] = {}  # name: when its delete began
            for target, precondition in checked.items():
                since = time.monotonic()
                outcome = self.delete_checked(target, namespace, precondition)
                if outcome == CHANGED:
                    skipped.append(target)
                    continue
                if outcome == DELETED:
                    deleted[target] = since
                self.log.info("%s %s/%s %s", self.kind, namespace, target, outcome)
            names = [target for target in checked if target not in skipped]
            if self.wait_for_deletion:
                pods_left = self.pods_left
                for target, since in deleted.items():
                    wait_until_gone(self.kind, target, namespace, self.get_object, self.deletion_timeout,
                                    self.poll_interval, self.log,
                                    partial(pods_left, target, namespace) if pods_left is not None else None,
                                    since)
        key = self.reference_name
        return {key: (names or skipped)[0] if len(names or skipped) == 1 else None, f"{key}s": names,
                "namespace": namespace, "deleted": bool(deleted), "skipped": skipped}
