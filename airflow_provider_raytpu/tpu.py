"""The TPU slice shape, and everything derived from it.

A user declares a generation and a topology ("v6e", "4x4"); hosts, chips, GKE node
labels, Ray resources, pod types and the hosts' machine type all follow from that here
and nowhere else. The shapes are GKE's (:mod:`airflow_provider_raytpu.gke_tpu`, cited
there), and Ray's (``ray._private.accelerators.tpu``, restated without importing Ray so
that DAG parsing stays cheap) where Ray knows more; a test holds every shape both know
to the same hosts, chips and resources as Ray derives.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from airflow_provider_raytpu.capacity import ON_DEMAND, SPOT, Capacity, with_spot
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.gke_tpu import GKE_TOPOLOGIES, HOST_MACHINES, MACHINE_TYPES, MachineType, offered_shapes
from airflow_provider_raytpu.values import parse_bool, parse_int, parse_optional_int, plural

CHIPS_PER_HOST = 4
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
#: The most slices one RayCluster takes: more than the largest multislice runs published (199 v5e slices).
MAX_SLICES = 256
TOO_MANY_SLICES = ": a typo, or several clusters' worth of TPU slices in one"

# v5e/v6e topologies that fit on one host of up to 8 chips.
_SINGLE_HOST_TOPOLOGIES = ("1x1", "2x2", "2x4")


def _larger_3d_topologies(max_x: int, max_y: int, max_z: int) -> frozenset[str]:
    step = CHIPS_PER_HOST
    return frozenset(
        f"{x}x{y}x{z}"
        for x in range(step, max_x + 1, step)
        for y in range(step, max_y + 1, step)
        for z in range(step, max_z + 1, step)
    )


# Ray's VALID_TPU_TOPOLOGY (ray/_private/accelerators/tpu.py, Ray 2.60).
_SMALL_3D = frozenset({"2x2x1", "2x2x2", "2x2x4", "2x4x4"})
_LITE_2D = frozenset({"1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16"})


@dataclass(frozen=True)
class Generation:
    """One TPU generation as GKE and Ray name it.

    :param name: the name users write, e.g. ``v5e``.
    :param ray_version: Ray's spelling, used in pod types (``v5litepod``).
    :param gke_accelerator: the ``cloud.google.com/gke-tpu-accelerator`` node label.
    :param cores_per_chip: TensorCores per chip; pod types count cores.
    :param ray_topologies: the slice shapes Ray's ``VALID_TPU_TOPOLOGY`` knows.
    """

    name: str
    ray_version: str
    gke_accelerator: str
    cores_per_chip: int
    ray_topologies: frozenset[str]

    @cached_property
    def gke_topologies(self) -> frozenset[str]:
        """The slice shapes GKE offers (:data:`~airflow_provider_raytpu.gke_tpu.GKE_TOPOLOGIES`)."""
        return GKE_TOPOLOGIES[self.name]

    @cached_property
    def topologies(self) -> frozenset[str]:
        """Every shape a slice may have: GKE's, and Ray's (on ``backend: kubernetes``, with a warning)."""
        return self.gke_topologies | self.ray_topologies

    @property
    def dimensions(self) -> int:
        return len(next(iter(self.ray_topologies)).split("x"))

    @property
    def packs_eight_chips(self) -> bool:
        """v5e and v6e put up to 8 chips on a single host."""
        return self.cores_per_chip == 1


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "v4", "tpu-v4-podslice", 2, _SMALL_3D | _larger_3d_topologies(12, 12, 16)),
        Generation("v5e", "v5litepod", "tpu-v5-lite-podslice", 1, _LITE_2D),
        Generation("v5p", "v5p", "tpu-v5p-slice", 2, _SMALL_3D | _larger_3d_topologies(16, 16, 24)),
        Generation("v6e", "v6e", "tpu-v6e-slice", 1, _LITE_2D),
        Generation(
            "v7x",
            "v7x",
            "tpu7x",
            2,
            _SMALL_3D | frozenset({"4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"}),
        ),
    )
}

_ALIASES = {
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "v5-lite": "v5e",
    "v5-litepod": "v5e",
}
_GKE_LABEL_TO_GENERATION = {g.gke_accelerator: g.name for g in GENERATIONS.values()}
_POD_TYPE = re.compile(r"^(?:tpu-?)?(v\d+[a-z]*)-(\d+)$")
_SHAPE = re.compile(r"^\d+(?:x\d+){1,2}$")


def parse_generation(value: Any, field: str = "accelerator") -> Generation:
    """Read a generation as users write it: ``v6e``, ``TPU-V6E``, ``v5litepod``.

    :param value: the accelerator as given.
    :param field: the parameter name used in errors.
    """
    supported = ", ".join(GENERATIONS)
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(field, value, "is not a TPU generation", f"Write one of: {supported}")
    text = value.strip().lower()
    if text in _GKE_LABEL_TO_GENERATION:
        name = _GKE_LABEL_TO_GENERATION[text]
        raise InvalidInputError(
            field,
            value,
            f"is the GKE node label {GKE_ACCELERATOR_LABEL}, not a generation",
            f"Write accelerator={name!r}; the node label is derived from it",
        )
    if pod_type := _POD_TYPE.match(text):
        name = _ALIASES.get(pod_type.group(1), pod_type.group(1))
        raise InvalidInputError(
            field,
            value,
            "is a pod type (generation-cores), not a generation",
            f"Write accelerator={name!r} and give the slice shape as topology, e.g. topology='4x4'",
        )
    name = re.sub(r"^tpu-?", "", text)
    name = _ALIASES.get(name, name)
    if name not in GENERATIONS:
        raise InvalidInputError(
            field, value, "is not a TPU generation offered on GKE", f"Write one of: {supported}"
        )
    return GENERATIONS[name]


def _chip_count(topology: str) -> int:
    return math.prod(_dims(topology))


def _dims(topology: str) -> tuple[int, ...]:
    return tuple(int(d) for d in topology.split("x"))


def valid_topologies(generation: Generation) -> list[str]:
    """The shapes GKE offers of the generation, smallest first, one spelling per set of dimensions."""
    spellings: dict[tuple[int, ...], str] = {}
    for topology in generation.gke_topologies:
        key = tuple(sorted(_dims(topology)))
        if key not in spellings or _dims(topology) < _dims(spellings[key]):
            spellings[key] = topology
    return sorted(spellings.values(), key=lambda t: (_chip_count(t), _dims(t)))


def parse_topology(value: Any, generation: Generation, field: str = "topology") -> str:
    """Check a slice shape against the generation and return it normalised (``"4x4"``).

    :param value: the topology as given.
    :param generation: the parsed generation.
    :param field: the parameter name used in errors.
    """
    text = str(value).strip().lower() if isinstance(value, (str, int)) else ""
    example = "'4x4'" if generation.dimensions == 2 else "'2x2x2'"
    if text.isdigit():
        shapes = [t for t in valid_topologies(generation) if _chip_count(t) == int(text)]
        hint = (
            f"{text} chips of {generation.name} is topology {' or '.join(repr(s) for s in shapes)}"
            if shapes
            else f"valid {generation.name} shapes: {', '.join(valid_topologies(generation))}"
        )
        raise InvalidInputError(
            field,
            value,
            f"topology is a slice shape such as {example}, not a chip count",
            f"Write the shape instead: {hint}",
        )
    if not _SHAPE.match(text):
        raise InvalidInputError(
            field,
            value,
            "is not a slice shape",
            f"Write 2 or 3 positive whole numbers joined by 'x', such as {example}",
        )
    if any(int(d) == 0 for d in text.split("x")):
        raise InvalidInputError(
            field, value, "has a zero dimension", f"Every dimension is at least 1, such as {example}"
        )
    if len(text.split("x")) != generation.dimensions:
        raise InvalidInputError(
            field,
            value,
            f"{generation.name} slices have {generation.dimensions} dimensions",
            f"Write a {generation.dimensions}-dimensional shape such as {example}",
        )
    if text not in generation.topologies:
        raise InvalidInputError(
            field,
            value,
            f"is not a {generation.name} slice shape",
            f"The shapes GKE offers of {generation.name}: {offered_shapes(generation.name)}",
        )
    return text


def _allowed_chips_per_host(generation: Generation, topology: str) -> tuple[int, ...]:
    chips = _chip_count(topology)
    if generation.packs_eight_chips and topology in _SINGLE_HOST_TOPOLOGIES:
        if chips == 1:
            return (1,)
        return tuple(c for c in (CHIPS_PER_HOST, 8) if c <= chips and chips % c == 0)
    return (min(CHIPS_PER_HOST, chips),)  # v7x 1x1x1 is one chip on tpu7x-standard-1t


@dataclass(frozen=True)
class TpuSlice:
    """A TPU slice shape: generation, topology and how many such slices.

    Immutable and pure. Inputs are parsed strictly (strings from rendered templates
    included) and checked against the generation, so an invalid shape fails before
    anything is created.

    :param accelerator: the TPU generation, e.g. ``"v6e"`` (also ``"TPU-V6E"``,
        ``"v5litepod"``); never a GKE label or a chip count.
    :param topology: the slice shape, e.g. ``"4x4"`` or ``"2x2x2"``.
    :param num_slices: how many identical slices (multislice), at least 1.
    :param spot: deprecated: write ``capacity="spot"``. Read back, whether the capacity is spot.
    :param chips_per_host: chips per host when the generation offers a choice
        (v5e/v6e ``2x4`` is one 8-chip host by default, or two 4-chip hosts with 4).
    :param capacity: where the TPUs come from: ``on-demand`` (default), ``spot``, ``reservation:<name>`` or
        ``flex-start`` (:class:`~airflow_provider_raytpu.capacity.Capacity`).
    """

    accelerator: str
    topology: str
    num_slices: int = 1
    spot: bool = False
    chips_per_host: int | None = None
    capacity: Capacity = Capacity()

    def __post_init__(self) -> None:
        generation = parse_generation(self.accelerator)
        topology = parse_topology(self.topology, generation)
        num_slices = parse_int(self.num_slices, "num_slices", maximum=MAX_SLICES, why_maximum=TOO_MANY_SLICES)
        spot = parse_bool(self.spot, "spot")
        if spot and Capacity.parse(self.capacity).kind != SPOT:
            warnings.warn("TpuSlice(spot=True) is deprecated: write capacity='spot'", DeprecationWarning, stacklevel=3)
        chips_per_host = parse_optional_int(self.chips_per_host, "chips_per_host", example=4)
        allowed = _allowed_chips_per_host(generation, topology)
        if chips_per_host is not None and chips_per_host not in allowed:
            raise InvalidInputError(
                "chips_per_host",
                self.chips_per_host,
                f"a {generation.name} {topology} slice cannot have {chips_per_host} chips per host",
                f"Write one of {', '.join(map(str, allowed))}, or leave it unset",
            )
        object.__setattr__(self, "accelerator", generation.name)
        object.__setattr__(self, "topology", topology)
        object.__setattr__(self, "num_slices", num_slices)
        capacity = with_spot(spot, self.capacity)
        object.__setattr__(self, "spot", capacity.kind == SPOT)
        object.__setattr__(self, "chips_per_host", chips_per_host)
        object.__setattr__(self, "capacity", capacity)

    @classmethod
    def from_fields(cls, *, accelerator: str, topology: str, num_slices: int | str = 1,
                    chips_per_host: int | str | None = None, capacity: Capacity | str | None = None) -> TpuSlice:
        """The slice a task's fields declare, as written or as their templates rendered (strings)."""
        slices = parse_int(num_slices, "num_slices", maximum=MAX_SLICES, why_maximum=TOO_MANY_SLICES)
        chips = parse_optional_int(chips_per_host, "chips_per_host", example=4)
        return cls(accelerator, topology, slices, chips_per_host=chips, capacity=Capacity.parse(capacity))

    @cached_property
    def generation(self) -> Generation:
        return GENERATIONS[self.accelerator]

    @property
    def chips_per_slice(self) -> int:
        return _chip_count(self.topology)

    @property
    def total_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def host_chips(self) -> int:
        """Chips on each host: Ray's rule unless ``chips_per_host`` chose otherwise."""
        if self.chips_per_host is not None:
            return self.chips_per_host
        if self.generation.packs_eight_chips and self.topology in _SINGLE_HOST_TOPOLOGIES:
            return self.chips_per_slice
        return min(CHIPS_PER_HOST, self.chips_per_slice)

    @property
    def hosts_per_slice(self) -> int:
        return max(1, self.chips_per_slice // self.host_chips)

    @property
    def total_hosts(self) -> int:
        return self.hosts_per_slice * self.num_slices

    @property
    def is_multi_host(self) -> bool:
        return self.hosts_per_slice > 1

    @property
    def offered_on_gke(self) -> bool:
        """Whether GKE offers this shape (a Ray-only shape such as v6e 2x8 makes a node pool GKE cannot create)."""
        return self.topology in self.generation.gke_topologies and self.host_chips in HOST_MACHINES[self.accelerator]

    @property
    def machine_type(self) -> MachineType | None:
        """The GKE machine type of each host (``ct6e-standard-4t``), or ``None`` for a shape GKE does not offer."""
        name = HOST_MACHINES[self.accelerator].get(self.host_chips)
        return MACHINE_TYPES[name] if name and self.offered_on_gke else None

    def not_offered(self) -> str | None:
        """Why GKE cannot make this shape's node pool (naming the shapes it offers), or ``None``."""
        if self.offered_on_gke:
            return None
        return (f"{self.accelerator} {self.topology} is not a slice shape GKE offers (a node pool of it cannot be "
                f"created, and its pods would stay Pending). The shapes GKE offers of {self.accelerator}: "
                f"{offered_shapes(self.accelerator)}")

    @property
    def pod_type(self) -> str:
        """The GCP accelerator type Ray uses, counting TensorCores: ``v6e-16``, ``v4-16``."""
        return f"{self.generation.ray_version}-{self.chips_per_slice * self.generation.cores_per_chip}"

    @property
    def ray_accelerator_type(self) -> str:
        """Ray's accelerator type resource, e.g. ``TPU-V6E``."""
        return f"TPU-{self.generation.ray_version.upper()}"

    @property
    def head_resource(self) -> str:
        """The Ray resource on host 0 of each slice, e.g. ``TPU-v6e-16-head``."""
        return f"TPU-{self.pod_type}-head"

    @property
    def node_selector(self) -> dict[str, str]:
        """GKE node labels a TPU host pod must land on."""
        return {
            GKE_ACCELERATOR_LABEL: self.generation.gke_accelerator,
            GKE_TOPOLOGY_LABEL: self.topology,
            **self.capacity.node_selector,
        }

    def describe(self) -> str:
        """One line for logs: ``v6e 4x4 x 2 slices (4 hosts x 4 chips each, 32 chips)``."""
        slices = plural(self.num_slices, "slice")
        capacity = "" if self.capacity.kind == ON_DEMAND else f", {self.capacity.describe()}"
        return (
            f"{self.accelerator} {self.topology} x {slices} "
            f"({plural(self.hosts_per_slice, 'host')} x {plural(self.host_chips, 'chip')} each, "
            f"{plural(self.total_chips, 'chip')}{capacity})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "accelerator": self.accelerator,
            "topology": self.topology,
            "num_slices": self.num_slices,
            "chips_per_host": self.chips_per_host,
            "capacity": str(self.capacity),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TpuSlice:
        """Rebuild a slice from :meth:`to_dict` output, rejecting unknown keys."""
        if not isinstance(data, dict):
            raise InvalidInputError("tpu", data, "is not a slice description", "Pass TpuSlice.to_dict() output")
        known = {"accelerator", "topology", "num_slices", "spot", "chips_per_host", "capacity"}
        if unknown := sorted(set(data) - known):
            raise InvalidInputError("tpu", data, f"has unknown keys {unknown}", f"Use only {sorted(known)}")
        if missing := sorted({"accelerator", "topology"} - set(data)):
            raise InvalidInputError("tpu", data, f"lacks {missing}", "Give accelerator and topology")
        data = dict(data)
        if parse_bool(data.pop("spot", False), "spot") and Capacity.parse(data.get("capacity")).kind == ON_DEMAND:
            data["capacity"] = SPOT  # recorded before capacity was: a cluster of an earlier version
        return cls.from_fields(**data)
