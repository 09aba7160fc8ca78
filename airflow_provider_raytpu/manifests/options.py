"""The pod and cluster options of a RayCluster beyond its slice shape, in one value.

:class:`RayClusterOptions` is what :func:`build_ray_cluster` and :func:`build_ray_service`
take and what ``CreateRayClusterOperator`` and ``DeployRayServiceOperator`` accept as
``cluster_options`` (or field by field as keyword arguments of the same names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.names import label_key_problem, label_value_problem, reserved_key_problem
from airflow_provider_raytpu.status.kueue import QUEUE_NAME_LABEL

DEFAULT_IMAGE = "rayproject/ray:2.60.0-py311-tpu"
DEFAULT_HEAD_RESOURCES = {"cpu": "2", "memory": "8Gi"}
DEFAULT_WORKER_RESOURCES = {"cpu": "8", "memory": "32Gi"}
#: A container's environment variable name, as the API server validates it (IsEnvVarName).
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


@dataclass(frozen=True)
class RayClusterOptions:
    """The image, resources, environment and pod settings of a RayCluster's head and TPU hosts.

    The slice shape is not here: it is the operators' ``accelerator``, ``topology``,
    ``num_slices``, ``chips_per_host`` and ``capacity``. Given to an operator, every field is
    templated, also inside mappings.

    :param image: the Ray image for head and TPU hosts (a ``-tpu`` image on GKE).
    :param ray_version: ``spec.rayVersion``; default: from the image tag.
    :param head_resources: cpu/memory of the head container (requests = limits);
        default: ``{"cpu": "2", "memory": "8Gi"}``.
    :param worker_resources: cpu/memory of each TPU host container; ``google.com/tpu`` is
        added; default: 3/4 of the host's GKE machine type's vCPUs and memory (ct6e-standard-4t:
        ``{"cpu": "135", "memory": "540G"}``; the rest is GKE's), ``{"cpu": "8", "memory": "32Gi"}``
        for a shape GKE does not offer.
    :param env: environment variables for every Ray container.
    :param head_ray_start_params: extra ``ray start`` flags for the head.
    :param worker_ray_start_params: extra ``ray start`` flags for the TPU hosts.
    :param service_account_name: the pods' Kubernetes service account (Workload Identity reaches GCS).
    :param labels: extra labels on the RayCluster or RayService (KubeRay copies a
        RayService's to its clusters).
    :param annotations: extra annotations on the RayCluster or RayService.
    :param head_pod_template: a pod-template fragment merged over the head's.
    :param worker_pod_template: a pod-template fragment merged over each TPU host's. It may not change the
        node selectors, TPU tolerations or ``google.com/tpu`` the slice shape renders, unless
        ``override_tpu_placement``.
    :param override_tpu_placement: let ``worker_pod_template`` change how TPU hosts are placed (the cluster
        records what was changed in ``raytpu.dev/tpu-placement-overridden``).
    """

    image: str = DEFAULT_IMAGE
    ray_version: str | None = None
    head_resources: Mapping[str, Any] | None = None
    worker_resources: Mapping[str, Any] | None = None
    env: Mapping[str, str] | None = None
    head_ray_start_params: Mapping[str, Any] | None = None
    worker_ray_start_params: Mapping[str, Any] | None = None
    service_account_name: str | None = None
    labels: Mapping[str, str] | None = None
    annotations: Mapping[str, str] | None = None
    head_pod_template: Mapping[str, Any] | None = None
    worker_pod_template: Mapping[str, Any] | None = None
    override_tpu_placement: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image.strip():
            raise InvalidInputError("image", self.image, "is not an image reference",
                                    f"Give an image such as {DEFAULT_IMAGE!r}")
        if not isinstance(self.override_tpu_placement, bool):
            raise InvalidInputError("override_tpu_placement", self.override_tpu_placement, "is not true or false",
                                    "Write True or False")
        for name in ("ray_version", "service_account_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(name, value, "is not a string", f"Give {name} as a string, or leave it out")
        for name in _MAPPING_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise InvalidInputError(
                    name, value, "is not a mapping",
                    f"Give {name} as a dict; to fill it from params, template its values "
                    "(e.g. {'cpu': '{{ params.cpu }}'}) or set render_template_as_native_obj=True on the DAG",
                )
        self._check_metadata()
        given_env: Mapping[str, object] = self.env or {}  # as given, not yet checked: any value
        for key, value in given_env.items():
            if not _templated(key) and not (isinstance(key, str) and _ENV_NAME.fullmatch(key)):
                raise InvalidInputError(
                    "env", key, "is not an environment variable name (Kubernetes takes letters, digits, '_', '-' "
                    "and '.', not starting with a digit)", "Rename it, e.g. env={'LOG_LEVEL': 'info'}")
            if _templated(value):
                continue
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise InvalidInputError(
                    f"env[{key!r}]", value, "is not a string (or a number)",
                    "Give every environment variable a string value, e.g. env={'LOG_LEVEL': 'info'}",
                )

    def _check_metadata(self) -> None:
        """Labels and annotations as Kubernetes takes them (the API server would refuse the object late)."""
        given: tuple[tuple[str, Mapping[str, object] | None], ...] = (  # as given, not yet checked: any value
            ("labels", self.labels), ("annotations", self.annotations))
        for field, values in given:
            for key, value in (values or {}).items():
                if _templated(key) or _templated(value):
                    continue  # rendered at run time, and checked then
                problem = label_key_problem(key) or reserved_key_problem(str(key))
                if problem is None and field == "labels":
                    problem = label_value_problem(value)
                elif problem is None and not isinstance(value, str):
                    problem = "is not a string"
                if problem is not None:
                    raise InvalidInputError(f"{field}[{key!r}]", value, problem,
                                            f"Write {field} of your own, as Kubernetes takes them, e.g. "
                                            f"{{'team': 'ml-platform'}}")

    def queued_in(self, queue: str | None) -> RayClusterOptions:
        """These options with the Kueue LocalQueue label (``None``: as they are).

        :raises InvalidInputError: ``labels`` name another queue.
        """
        if queue is None:
            return self
        given = (self.labels or {}).get(QUEUE_NAME_LABEL)
        if given not in (None, queue):
            raise InvalidInputError(
                f"labels[{QUEUE_NAME_LABEL!r}]", given, f"names another queue than queue_name={queue!r}",
                "Give the queue once, as queue_name",
            )
        return replace(self, labels={**(self.labels or {}), QUEUE_NAME_LABEL: queue})

    @classmethod
    def from_value(cls, value: object) -> RayClusterOptions:
        """Read an operator's ``cluster_options`` after templating: these options, a dict of their fields or None."""
        if isinstance(value, RayClusterOptions):
            return value
        return cls(**_option_dict(value))

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as a plain dict (what an operator templates)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


OPTION_NAMES = tuple(f.name for f in fields(RayClusterOptions))


def _templated(value: Any) -> bool:
    """A value an operator renders at run time (a Jinja string, an ``XComArg``): checked once rendered."""
    return (isinstance(value, str) and "{{" in value) or hasattr(value, "resolve")
_MAPPING_FIELDS = tuple(f.name for f in fields(RayClusterOptions) if str(f.type).startswith("Mapping"))


def take_cluster_options(
    cluster_options: RayClusterOptions | Mapping[str, Any] | str | None, arguments: MutableMapping[str, Any]
) -> dict[str, Any] | str:
    """An operator's ``cluster_options`` as one templatable value, with the options given one by one moved in.

    Pops every option name (``image``, ``env``, ...) out of ``arguments`` (an operator's
    keyword arguments) into the result: a plain dict, so that templating renders every
    field, also inside mappings. A template string is kept as it is; it must render a dict.

    :param cluster_options: the operator's ``cluster_options``.
    :param arguments: the operator's other keyword arguments; the option names are removed.
    :raises InvalidInputError: an option set twice, or flat options next to a template string.
    """
    flat = {name: arguments.pop(name) for name in OPTION_NAMES if name in arguments}
    if isinstance(cluster_options, str):
        if flat:
            raise InvalidInputError(
                "cluster_options", cluster_options, f"is a template, so {', '.join(flat)} cannot be added to it",
                "Put those options into what the template renders, or give cluster_options as a dict",
            )
        return cluster_options
    given = cluster_options.to_dict() if isinstance(cluster_options, RayClusterOptions) else _option_dict(
        cluster_options)
    if twice := sorted(set(flat) & set(given)):
        field = twice[0]
        raise InvalidInputError(
            field, flat[field], f"is given both as a keyword argument and in cluster_options ({given[field]!r})",
            f"Set {', '.join(twice)} in one place: either in cluster_options or as a keyword argument",
        )
    return {**given, **flat}


def _option_dict(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            "cluster_options", value, "is not a dict of cluster options",
            f"Give RayClusterOptions(...) or a dict with some of: {', '.join(OPTION_NAMES)}; a template that renders "
            "a dict needs render_template_as_native_obj=True on the DAG",
        )
    if unknown := sorted(set(value) - set(OPTION_NAMES)):
        raise InvalidInputError("cluster_options", unknown, "are not cluster options",
                                f"Use only: {', '.join(OPTION_NAMES)}")
    return dict(value)


#: The options of a cluster given none (frozen, so one value serves every default). Made last: its
#: ``__post_init__`` checks use this module's helpers.
DEFAULT_CLUSTER_OPTIONS = RayClusterOptions()
