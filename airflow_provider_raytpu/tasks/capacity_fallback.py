"""A create task given several capacity kinds tries them in order.

``capacity=["reservation:r1", "spot"], fallback_after=timedelta(minutes=20)``: the cluster is made on the first
kind and the task defers until its TPU hosts are placed on nodes. A kind that has not placed every host by
``fallback_after`` (the reservation is used up, spot capacity is short, Kueue does not admit it) is given
up: the cluster is deleted, the task waits until it and its pods are gone (never two of its slices at once),
and makes it again on the next kind. The last kind is kept however long it waits (the ready sensor waits on
it). What was tried is a warning line at each switch, an annotation on the cluster (a retry of the task goes
on from the kind the cluster has, and still knows what was tried before) and the task's ``capacity`` XCom.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_raytpu.backends.apply import CLUSTER_OWNER, check_owner, wait_until_gone
from airflow_provider_raytpu.backends.base import ChangedSinceChecked, Precondition
from airflow_provider_raytpu.capacity import Capacity, parse_capacities
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import CAPACITY_TRIED_ANNOTATION, tpu_slice_of
from airflow_provider_raytpu.status.conditions import parse_time
from airflow_provider_raytpu.tasks.base import ClusterTaskMixin, fail_fast, origin_of
from airflow_provider_raytpu.triggers.raycluster import RayClusterReadyTrigger
from airflow_provider_raytpu.values import parse_duration

if TYPE_CHECKING:
    from airflow.sdk import Context

#: The XCom key of what a create task tried: ``{"used": "spot", "tried": [{"capacity", "outcome"}, ...]}``.
CAPACITY_XCOM_KEY = "capacity"


def parse_fallback_after(value: Any, kinds: tuple[Capacity, ...]) -> timedelta | None:
    """``fallback_after`` for these kinds: required with more than one, a positive duration.

    :raises InvalidInputError: missing with a list, or not a duration.
    """
    if len(kinds) == 1:
        return None
    if value is None:
        raise InvalidInputError(
            "fallback_after", value, f"is needed when capacity lists {len(kinds)} kinds "
            f"({', '.join(map(str, kinds))}): it says how long each may take to place the slices",
            "Give e.g. fallback_after=timedelta(minutes=20)")
    return parse_duration(value, "fallback_after", example="timedelta(minutes=20)")


def resume_at(cluster: dict[str, Any] | None, kinds: tuple[Capacity, ...]) -> tuple[int, list[dict[str, str]]]:
    """Where a try goes on: the kind an earlier try left the cluster on, and what was tried before it."""
    recorded = tpu_slice_of(cluster) if cluster else None
    if recorded is None or recorded.capacity not in kinds:
        return 0, []
    tried = ((cluster or {}).get("metadata", {}).get("annotations") or {}).get(CAPACITY_TRIED_ANNOTATION)
    return kinds.index(recorded.capacity), json.loads(tried) if tried else []


def age_of(cluster: dict[str, Any]) -> float:
    """Seconds since the object was created (``metadata.creationTimestamp``; 0 when it has none)."""
    created = cluster.get("metadata", {}).get("creationTimestamp")
    if not created:
        return 0.0
    return (datetime.now(UTC) - parse_time(created)).total_seconds()


class CapacityFallbackMixin(ClusterTaskMixin):
    """The part of :class:`~airflow_provider_raytpu.operators.raycluster.CreateRayClusterOperator` that tries a
    list of capacity kinds (see the module). The operator makes or adopts the cluster on one kind in
    :meth:`apply_on`. (A mixin, not a ``BaseOperator``: Airflow wraps the ``__init__`` of every operator class
    that does not define its own a second time, which breaks ``partial``/``expand``.)"""

    capacity: Any
    fallback_after: Any

    def apply_on(self, context: Context, capacity: Capacity) -> dict[str, Any]:
        """Make or adopt the cluster on ``capacity``; return its reference."""
        raise NotImplementedError

    def try_capacity(self, context: Context, kinds: tuple[Capacity, ...], index: int,
                     tried: list[dict[str, str]]) -> dict[str, Any] | None:
        """Make the cluster on ``kinds[index]``; with more kinds after it, defer until its hosts are placed."""
        reference = self.apply_on(context, kinds[index])
        name, namespace = reference["cluster_name"], reference["namespace"]
        if tried:
            self.backend.annotate_cluster(name, namespace, {CAPACITY_TRIED_ANNOTATION: json.dumps(tried)})
        window = parse_fallback_after(self.fallback_after, kinds)
        if window is None or index == len(kinds) - 1:
            return self.keep(context, reference, kinds, index, tried, "the last kind listed: kept")
        self.log.info("RayCluster %s/%s: waiting up to %.0f s for %s to place its TPU hosts, else %s", namespace,
                      name, window.total_seconds(), kinds[index].describe(), kinds[index + 1].describe())
        self.defer(
            trigger=RayClusterReadyTrigger(
                cluster_name=name, namespace=namespace, raytpu_conn_id=self.conn_id,
                deadline=time.time() + window.total_seconds(), poll_interval=10.0,
                # A quota or admission refusal is a capacity not there yet: the window, not the grace, decides.
                grace_period=window.total_seconds() + 60, confirm_with_ray=False),
            # What the resumed task needs is on the cluster (its capacity, what was tried, its creation time):
            # no defer kwargs, which dag.test() drops, to carry.
            method_name="execute_fallback",
            timeout=window + timedelta(minutes=2),
        )

    def execute_fallback(self, context: Context, event: dict[str, Any]) -> dict[str, Any] | None:
        """The window of the cluster's kind ended: keep the cluster if its hosts are placed, else try the next."""
        name, namespace = event["cluster_name"], event["namespace"]
        if event["status"] == "ERROR":
            raise AirflowFailException(event["message"])
        cluster = self.backend.get_cluster(name, namespace)
        if event["status"] in ("UNREACHABLE", "GONE") or cluster is None:  # a retry goes on from the cluster's kind
            raise AirflowException(event.get("message") or f"RayCluster {namespace}/{name} is gone")
        origin = origin_of(context, self.hook.deployment)
        mine = {"kind": "RayCluster", "metadata": {"name": name, "namespace": namespace,
                                                   "annotations": origin.annotations()}}
        with fail_fast():  # replaced by another DAG's while this task was deferred: never delete theirs
            check_owner(cluster, mine, CLUSTER_OWNER)
        kinds = parse_capacities(self.capacity)
        index, tried = resume_at(cluster, kinds)
        kind, waited = kinds[index], age_of(cluster)
        recorded = tpu_slice_of(cluster)
        reference = self.cluster_reference(name, namespace, recorded.to_dict() if recorded else None)
        status = self.backend.cluster_status(name, namespace)
        placed = f"{status.scheduled_hosts} of {status.desired_hosts} TPU hosts placed in {waited:.0f} s"
        all_placed = status.desired_hosts and status.scheduled_hosts >= status.desired_hosts
        if event["status"] != "TIMEOUT" or all_placed or index == len(kinds) - 1:
            return self.keep(context, reference, kinds, index, tried, placed)
        following = kinds[index + 1]
        self.log.warning("RayCluster %s/%s: %s has %s; deleting it to make it on %s.\n%s", namespace, name,
                         kind.describe(), placed, following.describe(), event.get("diagnosis", ""))
        backend, since = self.backend, time.monotonic()
        try:
            backend.delete_cluster(name, namespace, Precondition.of(cluster))
        except ChangedSinceChecked as exc:  # a retry reads the cluster that is there now and checks it again
            raise AirflowException(f"{exc}; a retry of this task checks it again") from None
        wait_until_gone("RayCluster", name, namespace, backend.get_cluster, log=self.log,
                        pods_left=lambda: [p["metadata"]["name"] for p in backend.cluster_pods(name, namespace)],
                        deleting_since=since)
        return self.try_capacity(context, kinds, index + 1, [*tried, {"capacity": str(kind), "outcome": placed}])

    def keep(self, context: Context, reference: dict[str, Any], kinds: tuple[Capacity, ...], index: int,
             tried: list[dict[str, str]], outcome: str) -> dict[str, Any]:
        """The cluster stays on ``kinds[index]``: record what was tried (the ``capacity`` XCom, with a list of kinds)
        and return its reference."""
        kind = kinds[index]
        if len(kinds) > 1:
            record = {"used": str(kind), "tried": [*tried, {"capacity": str(kind), "outcome": outcome}]}
            context["ti"].xcom_push(key=CAPACITY_XCOM_KEY, value=record)
        if tried:
            self.log.info("RayCluster %s/%s is on %s after trying %s", reference["namespace"],
                          reference["cluster_name"], kind.describe(), ", ".join(t["capacity"] for t in tried))
        return reference
