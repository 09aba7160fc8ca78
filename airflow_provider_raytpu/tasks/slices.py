"""The slice a task states, as one value (:class:`SliceFields`), checked as early as each part can be: literals
when the DAG is parsed, rendered templates before anything is created, and the shapes GKE offers once the task
knows its connection's backend."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_provider_raytpu.capacity import Capacity, parse_capacities, with_spot
from airflow_provider_raytpu.errors import FatalError, InvalidInputError
from airflow_provider_raytpu.gke_tpu import offered_shapes
from airflow_provider_raytpu.progress import TaskLog
from airflow_provider_raytpu.tasks.base import is_templated
from airflow_provider_raytpu.tpu import Generation, TpuSlice, parse_generation, parse_topology
from airflow_provider_raytpu.values import parse_bool, parse_int, parse_optional_int, parse_slice_range

#: The template fields of a task that states a slice (``spot`` is the deprecated spelling of ``capacity="spot"``).
SLICE_FIELDS = ("accelerator", "topology", "num_slices", "chips_per_host", "capacity", "spot")
#: Backends that make only the node pools GKE offers (the local one emulates GKE).
GKE_SHAPES_ONLY = ("gke", "local")


@dataclass(frozen=True)
class SliceFields:
    """The slice fields a task was given: literals, or its templates as they rendered. ``None`` is not given.

    :param accelerator: the TPU generation, e.g. ``"v6e"``.
    :param topology: the slice shape, e.g. ``"4x4"``.
    :param num_slices: how many slices.
    :param chips_per_host: chips per host where the generation offers a choice.
    :param capacity: one capacity (``"spot"``, ``"reservation:r1"``), or a list to try in order.
    :param spot: the deprecated spelling of ``capacity="spot"``.
    """

    accelerator: Any = None
    topology: Any = None
    num_slices: Any = None
    chips_per_host: Any = None
    capacity: Any = None
    spot: Any = False

    @classmethod
    def of(cls, task: Any) -> SliceFields:
        """The fields as ``task`` holds them (rendered, once it runs)."""
        return cls(**{field.name: getattr(task, field.name) for field in fields(cls)})

    @property
    def templated(self) -> bool:
        """Whether a field is known only at run time (Jinja, ``XComArg``)."""
        return any(is_templated(getattr(self, field.name)) for field in fields(self))

    def capacities(self) -> tuple[Capacity, ...]:
        """The capacity kinds to try, in order; the deprecated ``spot=True`` is ``capacity="spot"``."""
        kinds = parse_capacities(self.capacity)
        if not parse_bool(self.spot, "spot"):
            return kinds
        if len(kinds) > 1:
            raise InvalidInputError("spot/capacity", (self.spot, self.capacity), "ask for spot and for a list of "
                                    "capacities at once", "Write the capacities alone (spot=True is capacity='spot')")
        return (with_spot(True, kinds[0]),)

    def tpu(self, capacity: Capacity | None = None) -> TpuSlice:
        """The slice these fields declare, on ``capacity`` (default: the one capacity given).

        :raises InvalidInputError: for a field that does not parse, or a capacity list where one is needed.
        """
        return TpuSlice.from_fields(accelerator=self.accelerator, topology=self.topology,
                                    num_slices=1 if self.num_slices is None else self.num_slices,
                                    chips_per_host=self.chips_per_host, capacity=capacity or self._one_capacity())

    def _one_capacity(self) -> Capacity:
        kinds = self.capacities()
        if len(kinds) > 1:
            raise InvalidInputError("capacity", self.capacity, "lists capacities to try in order, which only "
                                    "CreateRayClusterOperator does", "Write one capacity")
        return kinds[0]

    def check_literal(self, capacity_list: bool = False) -> None:
        """When the DAG is parsed: the shape, on each capacity of a list where the task takes one, unless a field
        is templated (checked when the task runs). The shapes GKE offers depend on the connection's backend, so
        they are checked then too.

        :param capacity_list: the task tries a list of capacities in order.
        """
        if self.templated:
            return
        for kind in self.capacities() if capacity_list else (None,):
            self.tpu(kind)

    def check_literal_parts(self) -> None:
        """When the DAG is parsed, for a task that may state part of a slice: each field given, as far as it can be
        read alone (a topology needs its accelerator)."""
        if self.templated:
            return
        if self.accelerator is not None and self.topology is not None:
            self.tpu()
        else:
            self._parsed(parse_generation(self.accelerator) if self.accelerator is not None else None)

    def against(self, recorded: TpuSlice | None, cluster: str) -> TpuSlice:
        """The cluster's slice, once every field stated here agrees with it; without a recorded slice, the slice
        these fields declare.

        :param recorded: the slice recorded on the cluster, or ``None`` (a cluster this provider did not make).
        :param cluster: ``RayCluster <namespace>/<name>``, for messages.
        :raises InvalidInputError: naming each stated field the cluster disagrees with, its value and the cluster's.
        """
        if recorded is None:
            if self.accelerator is None or self.topology is None:
                raise FatalError(f"{cluster} does not exist or records no slice shape; create it with "
                                 "CreateRayClusterOperator, or pass accelerator and topology")
            return self.tpu()
        kept = {"accelerator": recorded.accelerator, "topology": recorded.topology, "num_slices": recorded.num_slices,
                "chips_per_host": recorded.host_chips, "capacity": str(recorded.capacity)}
        differ = {name: (value, kept[name]) for name, value in self._parsed(recorded.generation).items()
                  if value != kept[name]}
        if differ:
            given = tuple(value for value, _ in differ.values())
            raise InvalidInputError(
                "/".join(differ), given[0] if len(given) == 1 else given,
                f"disagrees with {cluster}, which is {recorded.describe()}",
                f"Write {', '.join(f'{name}={value!r}' for name, (_, value) in differ.items())}, or leave "
                f"{'it' if len(differ) == 1 else 'them'} unset to train on the cluster's slice")
        return recorded

    def _parsed(self, generation: Generation | None) -> dict[str, Any]:
        """Each field given, parsed; a topology only where a generation reads it."""
        parsed: dict[str, Any] = {}
        if self.accelerator is not None:
            parsed["accelerator"] = parse_generation(self.accelerator).name
        if self.topology is not None and generation is not None:
            parsed["topology"] = parse_topology(self.topology, generation)
        if self.num_slices is not None:
            parsed["num_slices"] = parse_int(self.num_slices, "num_slices")
        if self.chips_per_host is not None:
            parsed["chips_per_host"] = parse_optional_int(self.chips_per_host, "chips_per_host", example=4)
        if self.capacity is not None or parse_bool(self.spot, "spot"):
            parsed["capacity"] = str(self._one_capacity())
        return parsed


def warn_spot(spot: Any) -> None:
    """Warn that ``spot`` is the deprecated spelling of ``capacity="spot"`` (unless it is the default)."""
    if spot is not False and not (isinstance(spot, str) and spot.strip().lower() == "false"):
        warnings.warn("spot is deprecated: write capacity='spot'", AirflowProviderDeprecationWarning, stacklevel=3)


def elastic_range(num_slices: Any, elastic_slices: Any) -> tuple[Any, tuple[int, int] | None]:
    """A training task's slice count to assert and its elastic ``(min, max)`` range. A range given as
    ``num_slices`` (the older spelling) is taken as ``elastic_slices``, with a deprecation warning.

    :raises InvalidInputError: for a range that does not parse, or a range given both ways.
    """
    older = None if is_templated(num_slices) else parse_slice_range(num_slices)
    if older is None:
        elastic = parse_slice_range(elastic_slices, "elastic_slices")
        if elastic is None and elastic_slices is not None:
            raise InvalidInputError("elastic_slices", elastic_slices, "is not a (min, max) range of slices",
                                    "Write e.g. (1, 2); to state the cluster's slice count, write num_slices")
        return num_slices, elastic
    warnings.warn("num_slices=(min, max) is deprecated: write elastic_slices=(min, max)",
                  AirflowProviderDeprecationWarning, stacklevel=3)
    if elastic_slices is not None:
        raise InvalidInputError("num_slices", num_slices, f"is a range, and elastic_slices={elastic_slices!r} is "
                                "given too", "Give the range as elastic_slices only")
    return None, older


def check_offered(tpu: TpuSlice, backend: str | None, log: TaskLog) -> None:
    """Refuse a shape GKE does not offer on a backend that makes only GKE's node pools; on ``kubernetes``
    (TPU nodes of your own), use it with one warning.

    :param backend: the connection's backend.
    :raises InvalidInputError: naming the shape and the shapes GKE offers.
    """
    problem = tpu.not_offered()
    if problem is None:
        return
    if backend not in GKE_SHAPES_ONLY:
        log.warning("%s. On backend %r it is used as given: the cluster's nodes must have it", problem, backend)
        return
    raise InvalidInputError(
        "topology", tpu.topology,
        f"is not a slice shape GKE offers of {tpu.accelerator}: a node pool of it cannot be created, so its pods "
        "would stay Pending",
        f"Write one of the shapes GKE offers: {offered_shapes(tpu.accelerator)}")
