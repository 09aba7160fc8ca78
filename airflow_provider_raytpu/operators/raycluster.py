"""Create and delete topology-aware RayClusters on TPU slices."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.exceptions import AirflowProviderDeprecationWarning
from airflow.sdk import BaseOperator

from airflow_provider_raytpu.backends.apply import CLUSTER_OWNER
from airflow_provider_raytpu.backends.base import Applied, ChangedSinceChecked, Precondition
from airflow_provider_raytpu.capacity import Capacity
from airflow_provider_raytpu.manifests.names import RAY_CLUSTER_NAME_LIMIT, check_queue_name, owned_name
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import (
    EXPIRES_AT_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    ORIGINATED_FROM_LABEL,
    build_ray_cluster,
    parse_expiry,
    tpu_slice_of,
)
from airflow_provider_raytpu.status import ClusterStatus
from airflow_provider_raytpu.status.kueue import QUEUE_NAME_LABEL
from airflow_provider_raytpu.status.usage import USAGE_XCOM_KEY, describe_usage, tpu_usage
from airflow_provider_raytpu.tasks.base import (
    ClusterTaskMixin,
    check_literal,
    cluster_options_of,
    fail_fast,
    is_templated,
    map_index_of,
    mark_outlets,
    origin_of,
)
from airflow_provider_raytpu.tasks.capacity_fallback import (
    CapacityFallbackMixin,
    parse_fallback_after,
    resume_at,
)
from airflow_provider_raytpu.tasks.deletion import DeleteOwnedOperator
from airflow_provider_raytpu.tasks.expiry import kept_because, parse_lifetime, renew_expiry
from airflow_provider_raytpu.tasks.links import RayDashboardLink, push_dashboard_link
from airflow_provider_raytpu.tasks.slices import SLICE_FIELDS, SliceFields, check_offered, warn_spot
from airflow_provider_raytpu.values import check_prices, parse_bool

if TYPE_CHECKING:
    from airflow.sdk import Context

def default_cluster_name(context: Context, deployment: str) -> str:
    """One cluster per DAG run and create task: the DAG and task ids, and a hash of DAG id, run id,
    task id, map index and deployment (so ``etl_daily`` and ``etl.daily`` differ, and staging's run
    never names prod's cluster), the same on every retry."""
    ti = context["ti"]
    return owned_name(f"{ti.dag_id}-{ti.task_id}",
                      (ti.dag_id, ti.run_id, ti.task_id, map_index_of(context), deployment), "cluster_name",
                      RAY_CLUSTER_NAME_LIMIT)


def without_queue_label(options: RayClusterOptions) -> RayClusterOptions:
    """``options``, warning when they give the Kueue queue as a label: the older spelling of ``queue_name``."""
    if queue := (options.labels or {}).get(QUEUE_NAME_LABEL):
        warnings.warn(f"The Kueue queue as labels[{QUEUE_NAME_LABEL!r}] is deprecated: write queue_name={queue!r}",
                      AirflowProviderDeprecationWarning, stacklevel=2)
    return options


class CreateRayClusterOperator(CapacityFallbackMixin, BaseOperator):
    """Create a RayCluster whose TPU worker group is ``num_slices`` whole slices of one shape.

    Declare the slice shape, never a chip count: hosts per slice, chips per host, the
    GKE node pool selector and Ray's TPU resources all follow from it. Slice fields are
    templated, so a UI trigger's params can choose the shape; they are parsed strictly
    and checked before any API call; written as literals they are checked when the DAG is
    parsed (a mistake shows as an import error). A retry adopts the cluster its first try
    made (same owner: DAG, run and task; same spec hash). A same-named cluster of another
    DAG, run or task, or one this provider did not make, is a conflict naming its owner;
    our own with another spec is a conflict too, unless ``update_if_exists``, which
    recreates it (delete, wait until gone, create: the pods of a RayCluster do not follow a
    spec change). Returns the cluster reference
    ``{"cluster_name", "namespace", "raytpu_conn_id", "tpu", "dashboard_url"}``.

    :param accelerator: TPU generation, e.g. ``"v6e"``.
    :param topology: slice shape, e.g. ``"4x4"``.
    :param num_slices: number of identical slices.
    :param chips_per_host: chips per host where the generation offers a choice.
    :param capacity: where the TPUs come from: ``"on-demand"`` (default), ``"spot"``, ``"reservation:<name>"``
        (``"reservation:<project>/<name>"`` shared, ``"reservation:any"``) or ``"flex-start"``
        (``"flex-start:24h"``: a max run duration); see :class:`~airflow_provider_raytpu.capacity.Capacity`.
        A list (``["reservation:r1", "spot"]``) is tried in order, with ``fallback_after``
        (:mod:`~airflow_provider_raytpu.tasks.capacity_fallback`): the task then defers until the slices
        are placed, and its ``capacity`` XCom says what was tried and what is used.
    :param fallback_after: with a capacity list, how long (a ``timedelta``, or seconds) each kind may take to
        place every TPU host before the cluster is deleted and made on the next kind.
    :param cluster_name: the RayCluster's name; default: the DAG and task ids and a hash of
        DAG id, run id, task id and map index (one cluster per DAG run and task, the same on every retry).
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: ``raytpu_default``.
    :param cluster_options: image, resources, env, ray start flags, service account, labels,
        annotations and pod-template fragments: a
        :class:`~airflow_provider_raytpu.manifests.options.RayClusterOptions` or a dict of
        its fields, every field templated. A field given as a keyword argument of its own
        (``image=...``, the older spelling) still counts, and warns.
    :param max_lifetime: after this (a ``timedelta``, or seconds), :class:`DeleteExpiredRayClustersOperator`
        deletes the cluster, unless a Ray job or its DAG run is still running; adopting the cluster (a
        retry, a Clear) renews it from then. A flex-start slice's max run duration bounds it.
    :param update_if_exists: recreate this task's own cluster when its spec differs, instead of failing.
    :param queue_name: a Kueue LocalQueue of the namespace: Kueue holds the cluster (suspended, no pods) until its
        ClusterQueue has quota for its slices; a wait for it says so (:mod:`~airflow_provider_raytpu.status.kueue`).
    """

    template_fields: Sequence[str] = (
        *SLICE_FIELDS,
        "cluster_name",
        "namespace",
        "raytpu_conn_id",
        "cluster_options",
        "update_if_exists",
        "fallback_after",
        "queue_name",
    )
    template_fields_renderers = {"cluster_options": "json"}
    operator_extra_links = (RayDashboardLink(),)
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        accelerator: str,
        topology: str,
        num_slices: int | str = 1,
        spot: bool | str = False,
        chips_per_host: int | str | None = None,
        capacity: str | None = None,
        cluster_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str | None = None,
        cluster_options: RayClusterOptions | Mapping[str, Any] | str | None = None,
        max_lifetime: timedelta | float = timedelta(hours=24),
        update_if_exists: bool | str = False,
        fallback_after: timedelta | float | str | None = None,
        queue_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        options = cluster_options_of(cluster_options, kwargs)
        check_literal(queue_name, check_queue_name)
        warn_spot(spot)
        stated = SliceFields(accelerator=accelerator, topology=topology, num_slices=num_slices,
                             chips_per_host=chips_per_host, capacity=capacity, spot=spot)
        stated.check_literal(capacity_list=True)
        if not is_templated((capacity, spot)):
            check_literal(fallback_after, lambda value: parse_fallback_after(value, stated.capacities()))
        check_literal(options, lambda value: without_queue_label(RayClusterOptions.from_value(value)))
        lifetime = parse_lifetime(max_lifetime)
        super().__init__(**kwargs)
        self.accelerator = accelerator
        self.topology = topology
        self.num_slices = num_slices
        self.spot = spot
        self.chips_per_host = chips_per_host
        self.capacity = capacity
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.cluster_options = options
        self.max_lifetime = lifetime
        self.update_if_exists = update_if_exists
        self.fallback_after = fallback_after
        self.queue_name = queue_name

    def execute(self, context: Context) -> dict[str, Any] | None:
        with fail_fast():
            stated = SliceFields.of(self)
            kinds = stated.capacities()
            for kind in kinds:
                stated.tpu(kind)
            parse_fallback_after(self.fallback_after, kinds)
            cluster = self.backend.get_cluster(self._name(context), self.resolved_namespace()) if kinds[1:] else None
            index, tried = resume_at(cluster, kinds)
        return self.try_capacity(context, kinds, index, tried)

    def _name(self, context: Context) -> str:
        return self.resolved_name() if self.cluster_name else default_cluster_name(context, self.hook.deployment)

    def apply_on(self, context: Context, capacity: Capacity) -> dict[str, Any]:
        with fail_fast():
            tpu = SliceFields.of(self).tpu(capacity)
            check_offered(tpu, self.hook.settings.backend, self.log)
            options = without_queue_label(RayClusterOptions.from_value(self.cluster_options)).queued_in(
                check_queue_name(self.queue_name))
            update_if_exists = parse_bool(self.update_if_exists, "update_if_exists")
            name = self._name(context)
            namespace = self.resolved_namespace()
            manifest = build_ray_cluster(
                name=name,
                namespace=namespace,
                tpu=tpu,
                options=options,
                origin=origin_of(context, self.hook.deployment),
                expires_at=datetime.now(UTC) + tpu.capacity.lifetime(self.max_lifetime),
            )
            self.log.info("RayCluster %s/%s: %s", namespace, name, tpu.describe())
            result = self.backend.apply_cluster(manifest, update_if_exists=update_if_exists)
            if result.action is Applied.ADOPTED:
                renew_expiry(self.backend, self.log, result.cluster, manifest)
        self.log.info("RayCluster %s/%s %s", namespace, name, result.action.value)
        push_dashboard_link(context, self.backend, name, namespace)
        return self.cluster_reference(name, namespace, tpu.to_dict())


def teardown_detail(status: ClusterStatus) -> str:
    """How far a cluster being deleted is: its head and TPU hosts still up."""
    head = "up" if status.head_ready else "down"
    return f"{status.message}; head {head}, {status.ready_hosts} of {status.desired_hosts} TPU hosts up"


class DeleteRayClusterOperator(DeleteOwnedOperator):
    """Delete a RayCluster; succeeds when it is already gone. Use it as a teardown task.

    ``delete.as_teardown(setups=[create, ready])`` runs it whatever happened upstream, so
    TPU slices are released even when training failed. Without ``cluster_name`` (and
    ``cluster``) it needs no XCom: it deletes the RayClusters this DAG run's create tasks
    made, found by their owner labels, so a create that applied the cluster and then
    failed still has it deleted. By default the task ends only once each RayCluster and
    its pods are gone, so a finished teardown means the slices are free; the log says
    which pods are still terminating at least every 10 s. A named RayCluster is deleted
    only when this DAG run's create tasks made it: another run's cluster of the same literal
    name (an overlapping run) is left alone with a warning naming its owner, unless
    ``force``. Returns ``{"cluster_name", "cluster_names", "namespace", "deleted", "skipped"}``.

    :param cluster: the cluster reference (``create.output``), instead of ``cluster_name``.
    :param cluster_name: the RayCluster's name; default: found by owner (see above).
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param created_by: delete what these create task ids made; default: the
        :class:`CreateRayClusterOperator` tasks upstream of this one, else every task of the run.
    :param force: delete the named RayCluster whoever made it (a cluster made by another DAG
        or outside Airflow, when this task is meant to end it).
    :param wait_for_deletion: wait until the RayCluster and its pods are gone (default ``True``).
    :param deletion_timeout: seconds to wait for that.
    :param poll_interval: seconds between checks while waiting.
    :param chip_hour_prices: a price per chip-hour by generation and capacity kind,
        ``{"v6e": {"on-demand": 2.7, "spot": 1.1}}``, for a cost estimate in the ``tpu_usage`` XCom; default:
        the connection's ``chip_hour_prices`` extra, else no estimate.

    Each deleted cluster's usage (:func:`~airflow_provider_raytpu.status.usage.tpu_usage`: chip-hours from
    ready to gone by capacity kind, slices made again meanwhile, the estimate) is a log line, a list in the
    ``tpu_usage`` XCom and, for each of the task's outlets, the asset event's ``tpu_usage`` extra.
    """

    template_fields: Sequence[str] = ("cluster", "cluster_name", "namespace", "raytpu_conn_id", "created_by")
    kind = "RayCluster"
    owner_keys = CLUSTER_OWNER
    name_limit = RAY_CLUSTER_NAME_LIMIT
    # A RayService's clusters carry its owner labels too (KubeRay copies them): they are the service's.
    other_selectors = (f"!{ORIGINATED_FROM_LABEL}",)

    def __init__(self, *, cluster: Any = None, cluster_name: str | None = None, wait_for_deletion: bool = True,
                 chip_hour_prices: Mapping[str, Mapping[str, float]] | None = None, **kwargs: Any) -> None:
        check_prices(chip_hour_prices)
        super().__init__(wait_for_deletion=wait_for_deletion, **kwargs)
        self.cluster = cluster
        self.cluster_name = cluster_name
        self.chip_hour_prices = chip_hour_prices
        self.last_seen: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    def execute(self, context: Context) -> dict[str, Any]:
        result = super().execute(context)
        gone = datetime.now(UTC)
        prices = check_prices(self.chip_hour_prices) if self.chip_hour_prices is not None else dict(
            self.hook.settings.chip_hour_prices or {})
        usages = [tpu_usage(cluster, pods, tpu, gone, prices)
                  for cluster, pods in self.last_seen.values() if (tpu := tpu_slice_of(cluster))]
        for usage in usages:
            self.log.info("%s", describe_usage(usage))
        if usages:
            context["ti"].xcom_push(key=USAGE_XCOM_KEY, value=usages)
            mark_outlets(self, {USAGE_XCOM_KEY: usages})
        return result

    def creates(self, task: Any) -> bool:
        return isinstance(task, CreateRayClusterOperator)

    def get_object(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.backend.get_cluster(name, namespace)

    def delete_object(self, name: str, namespace: str, precondition: Precondition) -> bool:
        cluster = self.backend.get_cluster(name, namespace)
        if cluster is not None and precondition.unmet(cluster) is None:  # as last seen, for its usage
            self.last_seen[name] = (cluster, self.backend.cluster_pods(name, namespace))
        try:
            return self.backend.delete_cluster(name, namespace, precondition)
        except ChangedSinceChecked:
            self.last_seen.pop(name, None)  # not deleted here: its usage is not this teardown's to report
            raise

    def list_objects(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.backend.list_clusters(namespace, label_selector)

    def deletion_detail(self, name: str, namespace: str) -> str:
        return teardown_detail(self.backend.cluster_status(name, namespace))

    def pods_left(self, name: str, namespace: str) -> list[str]:
        return [pod["metadata"]["name"] for pod in self.backend.cluster_pods(name, namespace)]


class DeleteExpiredRayClustersOperator(ClusterTaskMixin, BaseOperator):
    """Delete RayClusters this provider made whose expiry has passed, unless they are still in use.

    The safety net for TPU hours: a DAG that dies before its teardown leaves a cluster
    behind; schedule this hourly and it goes once its ``max_lifetime`` is over. A cluster
    whose DAG run is still running or queued, or that still runs a Ray job, is left alone
    (and logged); so is one whose expiry annotation is not a time. Returns the expired
    clusters deleted (with ``dry_run``: that would be), as ``namespace/name``.

    :param namespace: where to look; default: the connection's namespace.
    :param all_namespaces: look in every namespace instead.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param dry_run: only report what would be deleted.
    """

    template_fields: Sequence[str] = ("namespace", "raytpu_conn_id")

    def __init__(
        self,
        *,
        namespace: str | None = None,
        all_namespaces: bool = False,
        raytpu_conn_id: str | None = None,
        dry_run: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.namespace = namespace
        self.all_namespaces = all_namespaces
        self.raytpu_conn_id = raytpu_conn_id
        # Not ``self.dry_run``: that would hide BaseOperator.dry_run(), which renders the templates.
        self.report_only = dry_run

    def execute(self, context: Context) -> list[str]:
        now = datetime.now(UTC)
        expired = []
        with fail_fast():
            scope = None if self.all_namespaces else self.resolved_namespace()
            for cluster in self.backend.list_clusters(scope, f"{MANAGED_BY_LABEL}={MANAGED_BY}"):
                metadata = cluster["metadata"]
                where = f"{metadata['namespace']}/{metadata['name']}"
                expiry = (metadata.get("annotations") or {}).get(EXPIRES_AT_ANNOTATION)
                try:
                    if not expiry or parse_expiry(expiry) > now:
                        continue
                except ValueError:
                    self.log.warning("RayCluster %s: its %s annotation %r is not a time (YYYY-MM-DDTHH:MM:SSZ); "
                                     "skipped", where, EXPIRES_AT_ANNOTATION, expiry)
                    continue
                if (kept := kept_because(context["ti"], self.hook, cluster, self.log)) is not None:
                    self.log.info("RayCluster %s expired at %s but is not deleted: %s", where, expiry, kept)
                elif self.report_only:
                    self.log.info("RayCluster %s expired at %s (dry run)", where, expiry)
                    expired.append(where)
                elif self.delete_as_listed(cluster):
                    self.log.info("RayCluster %s expired at %s: deleted", where, expiry)
                    expired.append(where)
        return expired

    def delete_as_listed(self, cluster: dict[str, Any]) -> bool:
        """Delete the cluster only as it was listed and checked: a renewed expiry or a cluster made again since
        changes its resourceVersion, and the API server then refuses the delete."""
        metadata = cluster["metadata"]
        try:
            self.backend.delete_cluster(metadata["name"], metadata["namespace"], Precondition.of(cluster, exact=True))
        except ChangedSinceChecked as exc:
            self.log.info("%s; the next sweep decides again", exc)
            return False
        return True
