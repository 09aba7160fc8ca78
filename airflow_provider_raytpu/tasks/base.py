"""What the provider's operators and sensors share: the connection, the cluster reference, fail-fast errors."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.exceptions import AirflowProviderDeprecationWarning
from airflow.sdk import TriggerRule
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.manifests.names import (
    RAY_CLUSTER_NAME_LIMIT,
    RAY_SERVICE_NAME_LIMIT,
    check_namespace,
    resource_name,
)
from airflow_provider_raytpu.manifests.options import OPTION_NAMES, RayClusterOptions, take_cluster_options
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, tpu_slice_of
from airflow_provider_raytpu.status.run_report import TASK_SPAN_XCOM_KEY
from airflow_provider_raytpu.tpu import TpuSlice

if TYPE_CHECKING:
    import jinja2
    from airflow.sdk import BaseOperator, Context

    from airflow_provider_raytpu.backends.base import ClusterBackend, ServiceBackend

    # The mixins below become part of an operator: they are checked as the BaseOperator they join.
    _TaskBase = BaseOperator
else:
    _TaskBase = object

CONN_KEY = "raytpu_conn_id"
OLD_CONN_KEY = "conn_id"  # the reference's connection key before 0.2; still read from older XComs


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Fail the task without retries on errors only the user can fix (bad input, RBAC, conflicts)."""
    try:
        yield
    except FatalError as exc:
        raise AirflowFailException(str(exc)) from exc


def default_deferrable() -> bool:
    """``[operators] default_deferrable``, as the cncf-kubernetes and Google providers read it."""
    return bool(conf.getboolean("operators", "default_deferrable", fallback=False))


#: Seconds between a sensor's checks when it is not deferred (or its watch fails).
DEFAULT_POKE_INTERVAL = 10.0


def take_renamed(arguments: MutableMapping[str, Any], old: str, new: str, value: Any) -> Any:
    """``new``'s value; a value given under its deprecated name ``old`` (popped from ``arguments``, a task's
    keyword arguments) still counts, with a warning naming ``new``.

    :raises InvalidInputError: when both are given.
    """
    if old not in arguments:
        return value
    warnings.warn(f"{old} is deprecated: write {new}", AirflowProviderDeprecationWarning, stacklevel=3)
    older = arguments.pop(old)
    if value is not None:
        raise InvalidInputError(old, older, f"is given with {new}={value!r}",
                                f"Give only {new} ({old} is its deprecated name)")
    return older


def cluster_options_of(cluster_options: RayClusterOptions | Mapping[str, Any] | str | None,
                       arguments: MutableMapping[str, Any]) -> dict[str, Any] | str:
    """A create or deploy task's ``cluster_options``; options given one by one as keyword arguments (the
    deprecated spelling) still count, moved in, with a warning naming them.

    :param arguments: the task's other keyword arguments; the option names are removed.
    """
    if flat := [name for name in OPTION_NAMES if name in arguments]:
        warnings.warn(f"Cluster options as keyword arguments ({', '.join(flat)}) are deprecated: give them in "
                      f"cluster_options, e.g. cluster_options={{{flat[0]!r}: ...}}",
                      AirflowProviderDeprecationWarning, stacklevel=3)
    return take_cluster_options(cluster_options, arguments)


def is_templated(value: Any) -> bool:
    """Whether a parameter is only known at run time: a Jinja template or an ``XComArg``, also anywhere
    inside a dict or list."""
    from airflow_provider_raytpu.compat import resolvable_type

    if isinstance(value, Mapping):
        return any(is_templated(key) or is_templated(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(is_templated(item) for item in value)
    return isinstance(value, resolvable_type()) or (isinstance(value, str) and "{{" in value)


def check_import_path(value: Any, field: str) -> None:
    """Refuse what is not ``"package.module:name"`` (the job would fail only once it runs)."""
    from airflow_provider_raytpu.workloads.loading import split_import_path

    try:
        split_import_path(value if isinstance(value, str) else "")
    except ValueError:
        raise InvalidInputError(field, value, "is not an import path",
                                "Write 'package.module:name', e.g. 'pipeline.train:train_loop'") from None


def check_not_empty(value: Any, field: str, example: str) -> None:
    """Refuse an empty string, list or ``None`` where a value is needed."""
    if value is None or (isinstance(value, (str, list, tuple)) and not (value.strip() if isinstance(value, str)
                                                                        else value)):
        raise InvalidInputError(field, value, "is empty", f"Give it, e.g. {example}")


def check_literal(value: Any, check: Callable[[Any], object]) -> None:
    """Run ``check(value)`` when the DAG is parsed if ``value`` is a literal (a mistake is an import error);
    a templated value is checked at run time instead."""
    if not is_templated(value):
        check(value)


def mask_secret_values(values: Mapping[str, Any] | None) -> list[str]:
    """Register with Airflow's secrets masker the values, nested too, of keys that look secret (Airflow's
    own list: ``api_key``, ``password``, ``token``, ``secret``, ...): every log of the task shows them as ``***``.

    :param values: e.g. a training config or a job's environment variables.
    :returns: those values, as the masker hides them (what another process, the triggerer, registers again).
    """
    if not values:
        return []
    from airflow.sdk.log import mask_secret

    from airflow_provider_raytpu.compat import redact

    mask_secret(dict(values))
    return hidden_leaves(dict(values), redact(dict(values)))


def hidden_leaves(given: Any, shown: Any) -> list[str]:
    """The values in ``given`` that ``shown`` (the same structure, as Airflow's ``redact`` shows it) hides."""
    if isinstance(given, Mapping) and isinstance(shown, Mapping):
        return [leaf for key, value in given.items() for leaf in hidden_leaves(value, shown.get(key))]
    if isinstance(given, (list, tuple)) and isinstance(shown, (list, tuple)):
        return [leaf for value, seen in zip(given, shown, strict=False) for leaf in hidden_leaves(value, seen)]
    if given is None or isinstance(given, bool) or shown == given:
        return []
    return [str(given)]


def mark_outlets(task: Any, extras: Mapping[str, Any]) -> None:
    """Put ``extras`` (plain JSON) on the asset event of each of the running task's outlets.

    :param task: the running operator or sensor; without ``outlets`` nothing happens.
    :param extras: what a consumer of the asset reads from ``triggering_asset_events``.
    """
    if not task.outlets:
        return
    from airflow.sdk import get_current_context

    events = get_current_context()["outlet_events"]
    for outlet in task.outlets:
        events[outlet].extra.update(extras)


def map_index_of(context: Context) -> int:
    """The task instance's map index; -1 when it is not mapped."""
    map_index = context["ti"].map_index
    return -1 if map_index is None else int(map_index)


def origin_of(context: Context, deployment: str) -> AirflowOrigin:
    """The task instance an object made now belongs to: deployment, DAG, run, task and map index.

    :param deployment: the Airflow deployment (:attr:`RayTpuHook.deployment`).
    """
    ti = context["ti"]
    return AirflowOrigin(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=map_index_of(context),
                         deployment=deployment)


def read_reference(value: Any, field: str, name_key: str) -> dict[str, Any] | None:
    """A cluster or service reference as an upstream task returned it (``create.output``), checked.

    :param value: the rendered parameter; ``None`` when not given.
    :param field: the parameter's name (``cluster`` or ``service``).
    :param name_key: the key that must hold the name (``cluster_name`` or ``service_name``).
    """
    if value is None or value == "":
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get(name_key), str) or not value[name_key]:
        raise InvalidInputError(
            field, value, f"is not a reference with a {name_key}",
            f"Pass the task's output, e.g. {field}=create.output (the dict the creating task returns), "
            f"or give {name_key}, namespace and raytpu_conn_id instead",
        )
    return dict(value)


class TeardownWhateverHappenedMixin(_TaskBase):
    """An operator whose ``as_teardown`` runs it once everything upstream is done, also when every setup failed
    (a create can fail after applying its cluster; Airflow's own teardown rule would then skip it)."""

    def as_teardown(self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None) -> Any:
        """Airflow's ``as_teardown`` with the trigger rule ``all_done``."""
        super().as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        try:
            fail_fast = self.dag.fail_fast  # a fail_fast DAG allows the default trigger rules only
        except RuntimeError:  # not in a DAG yet
            fail_fast = False
        if not fail_fast:
            self.trigger_rule = TriggerRule.ALL_DONE
        return self


class ClusterTaskMixin(_TaskBase):
    """An operator or sensor that works on an existing RayCluster.

    It takes the cluster reference (``cluster=create.output``) or ``cluster_name``,
    ``namespace`` and ``raytpu_conn_id`` (all templated), or both, the explicit ones
    winning; the reference is read once the templates are rendered.
    """

    cluster_name: str | None
    namespace: str | None
    raytpu_conn_id: str | None
    cluster: Any = None
    #: Whether a READY waits for Ray to list every TPU host; ``None``: the connection's ``confirm_with_ray``.
    confirm_with_ray: bool | None = None
    reference_field = "cluster"
    reference_name = "cluster_name"
    #: The longest name KubeRay takes for the object (its Services append to it).
    name_limit: int = RAY_CLUSTER_NAME_LIMIT

    def render_template_fields(self, context: Context, jinja_env: jinja2.Environment | None = None) -> None:
        super().render_template_fields(context, jinja_env)
        with fail_fast():
            self.take_reference()

    def post_execute(self, context: Context, result: Any = None) -> None:
        """Record when this task's try ran (``raytpu_task_span``), for the run report's timeline."""
        start = context["ti"].start_date
        context["ti"].xcom_push(key=TASK_SPAN_XCOM_KEY, value={
            "start": start.isoformat() if start else None, "end": datetime.now(UTC).isoformat()})

    def take_reference(self) -> dict[str, Any] | None:
        """Fill the name, namespace and connection from the rendered reference, where not given."""
        reference = read_reference(getattr(self, self.reference_field, None), self.reference_field,
                                   self.reference_name)
        if reference is None:
            return None
        given, named = getattr(self, self.reference_name), reference[self.reference_name]
        if given and given != named:
            raise InvalidInputError(
                self.reference_name, given, f"disagrees with {self.reference_field}, which names {named!r}",
                f"Give either {self.reference_field} or {self.reference_name}",
            )
        setattr(self, self.reference_name, named)
        self.namespace = self.namespace or reference.get("namespace")
        if OLD_CONN_KEY in reference and CONN_KEY not in reference:
            warnings.warn(f"A cluster reference's {OLD_CONN_KEY!r} is deprecated: it is {CONN_KEY!r} (an XCom of a "
                          "task that ran an earlier version of this provider)", AirflowProviderDeprecationWarning,
                          stacklevel=2)
        self.raytpu_conn_id = self.raytpu_conn_id or reference.get(CONN_KEY) or reference.get(OLD_CONN_KEY)
        return reference

    def require_name(self) -> str:
        """The (rendered) name this task works on, or an error saying how to give it."""
        name = getattr(self, self.reference_name)
        if not name:
            raise InvalidInputError(
                self.reference_name, name, "is not given",
                f"Pass {self.reference_field}=<creating task>.output, or {self.reference_name}=...",
            )
        return str(name)

    def resolved_name(self) -> str:
        """:meth:`require_name` normalised into the object's name (lower case, ``-``, within its limit)."""
        return resource_name(self.require_name(), self.reference_name, self.name_limit)

    @property
    def conn_id(self) -> str:
        """The ``raytpu`` connection: given, from the reference, or ``raytpu_default``."""
        return self.raytpu_conn_id or DEFAULT_CONN_ID

    @cached_property
    def hook(self) -> RayTpuHook:
        """The task's one ``raytpu`` connection lookup and backend (every client of the task shares it)."""
        return RayTpuHook(self.conn_id)

    @property
    def backend(self) -> ClusterBackend:
        return self.hook.backend

    @property
    def confirms_with_ray(self) -> bool:
        """Whether a READY waits for Ray to list every TPU host: the task's ``confirm_with_ray``, else the
        connection's."""
        return self.backend.settings.confirm_with_ray if self.confirm_with_ray is None else self.confirm_with_ray

    def resolved_namespace(self) -> str:
        """The namespace (given, from the reference, or the connection's), checked before it reaches a URL."""
        if self.namespace:
            return check_namespace(self.namespace)
        return self.hook.settings.namespace

    def recorded_tpu(self, name: str, namespace: str) -> TpuSlice | None:
        """The slice shape recorded on the cluster; ``None`` when it is gone or records none."""
        return tpu_slice_of(self.backend.get_cluster(name, namespace) or {})

    def cluster_tpu(self, name: str, namespace: str) -> TpuSlice:
        """The slice shape recorded on the cluster.

        :raises FatalError: when the cluster is gone or records none.
        """
        recorded = self.recorded_tpu(name, namespace)
        if recorded is None:
            raise FatalError(f"RayCluster {namespace}/{name} does not exist or records no slice shape; create it "
                             "with CreateRayClusterOperator")
        return recorded

    def cluster_reference(self, name: str, namespace: str, tpu: dict[str, Any] | None) -> dict[str, Any]:
        """The cluster reference every later task takes (no secrets in it)."""
        return {
            "cluster_name": name,
            "namespace": namespace,
            CONN_KEY: self.conn_id,
            "tpu": tpu,
            "dashboard_url": self.backend.dashboard(name, namespace).url,
        }


class ServiceTaskMixin(ClusterTaskMixin):
    """An operator or sensor that works on a RayService.

    It takes the service reference (``service=deploy.output``) or ``service_name``,
    ``namespace`` and ``raytpu_conn_id`` (all templated), or both, the explicit ones winning.
    """

    service_name: str | None
    service: Any = None
    reference_field = "service"
    reference_name = "service_name"
    name_limit = RAY_SERVICE_NAME_LIMIT

    @property
    def service_backend(self) -> ServiceBackend:
        return self.hook.backend.services
