"""What GKE offers of each TPU generation: the slice shapes of its node pools and the machine types of their hosts.

Pure data, cited; :mod:`airflow_provider_raytpu.tpu` derives everything else from it. Read 2026-12 from:

- v6e: Cloud TPU "TPU v6e" (docs.cloud.google.com/tpu/docs/v6e), table "Topology, TPU chips, Hosts,
  VMs, Machine type (GKE API)": 1x1 on ct6e-standard-1t, 2x2 on ct6e-standard-4t, 2x4 on one
  ct6e-standard-8t or (GKE only) two ct6e-standard-4t, 4x4 ... 16x16 on ct6e-standard-4t. No 2x8.
- v5e: Cloud TPU "TPU v5e" (cloud.google.com/tpu/docs/v5e#configurations): 1x1, 2x2, 2x4, 4x4, 4x8,
  8x8, 8x16, 16x16; VM types ct5lp-hightpu-1t (24 vCPU, 48 GB), -4t (112, 192), -8t (224, 384).
- v5p: Cloud TPU "TPU v5p" (docs.cloud.google.com/tpu/docs/v5p): ct5p-hightpu-4t (208 vCPU,
  448 GB), shapes from 2x2x1; Google's xpk (``src/xpk/core/system_characteristics.py``) offers
  2x2x1, 2x2x2, 2x2x4, 2x4x4 and every AxBxC (A <= B <= C, multiples of 4) of up to 140 cubes
  (4x4x28, 16x20x28; Google's page says the largest job schedules 96 cubes, 16x16x24).
- v4: Cloud TPU "TPU types and topologies" (AxBxC, A <= B <= C, all <= 4 or all multiples of 4) and
  xpk: ct4p-hightpu-4t, up to 64 cubes (8x16x16, 16x16x16).
- v7x (Ironwood): GKE "About Ironwood (TPU7x) in GKE" (four chips per VM; node label ``tpu7x``),
  Cloud TPU "TPU7x" (tpu7x-standard-4t: 224 vCPU, 960 GB) and xpk: 1x1x1 on tpu7x-standard-1t,
  every other shape (up to 144 cubes: 4x4x12, 8x8x12, 12x12x12) on tpu7x-standard-4t.

Machine sizes not on Google's pages (ct4p-hightpu-4t, ct6e-standard-1t/-8t, tpu7x-standard-1t)
are Compute Engine's machine-type list as published. A host of a multi-host slice always has 4
chips: a slice has ``chips / 4`` hosts, KubeRay's ``numOfHosts``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The longest side of a 3D slice, in chips (xpk: "A, B and C are integers in range 4..256").
MAX_SIDE = 256


@dataclass(frozen=True)
class MachineType:
    """A TPU VM as GKE schedules it: one node, one host of a slice.

    :param name: the Compute Engine machine type, e.g. ``ct6e-standard-4t``.
    :param chips: TPU chips on it.
    :param vcpus: its vCPUs.
    :param memory_gb: its memory, in GB (10**9 bytes).
    """

    name: str
    chips: int
    vcpus: int
    memory_gb: int


MACHINE_TYPES: dict[str, MachineType] = {m.name: m for m in (
    MachineType("ct4p-hightpu-4t", 4, 240, 407),
    MachineType("ct5lp-hightpu-1t", 1, 24, 48),
    MachineType("ct5lp-hightpu-4t", 4, 112, 192),
    MachineType("ct5lp-hightpu-8t", 8, 224, 384),
    MachineType("ct5p-hightpu-4t", 4, 208, 448),
    MachineType("ct6e-standard-1t", 1, 44, 176),
    MachineType("ct6e-standard-4t", 4, 180, 720),
    MachineType("ct6e-standard-8t", 8, 360, 1440),
    MachineType("tpu7x-standard-1t", 1, 56, 240),
    MachineType("tpu7x-standard-4t", 4, 224, 960),
)}

#: Per generation: the machine type of a host with that many chips.
HOST_MACHINES: dict[str, dict[int, str]] = {
    "v4": {4: "ct4p-hightpu-4t"},
    "v5e": {1: "ct5lp-hightpu-1t", 4: "ct5lp-hightpu-4t", 8: "ct5lp-hightpu-8t"},
    "v5p": {4: "ct5p-hightpu-4t"},
    "v6e": {1: "ct6e-standard-1t", 4: "ct6e-standard-4t", 8: "ct6e-standard-8t"},
    "v7x": {1: "tpu7x-standard-1t", 4: "tpu7x-standard-4t"},
}

_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
_LITE_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


def cube_shapes(max_cubes: int) -> tuple[str, ...]:
    """Every AxBxC with A <= B <= C <= 256, each a multiple of 4, of at most ``max_cubes`` cubes (xpk's rule)."""
    shapes = []
    longest = MAX_SIDE // 4
    for a in range(1, longest + 1):  # in cubes along each axis: a <= b <= c, a * b * c <= max_cubes
        for b in range(a, min(longest, max_cubes // a) + 1):
            shapes += [f"{4 * a}x{4 * b}x{4 * c}" for c in range(b, min(longest, max_cubes // (a * b)) + 1)]
    return tuple(shapes)


#: Per generation: the slice shapes GKE offers.
GKE_TOPOLOGIES: dict[str, frozenset[str]] = {
    "v4": frozenset(_SMALL_3D + cube_shapes(64)),
    "v5e": frozenset(_LITE_2D),
    "v5p": frozenset(_SMALL_3D + cube_shapes(140)),
    "v6e": frozenset(_LITE_2D),
    "v7x": frozenset(("1x1x1", *_SMALL_3D, *cube_shapes(144))),
}

#: Per generation: the cubes of its largest slice (3D generations), for messages.
MAX_CUBES = {"v4": 64, "v5p": 140, "v7x": 144}


def offered_shapes(generation: str) -> str:
    """The shapes GKE offers of a generation, in words: all of them for a 2D generation, the rule for 3D.

    :param generation: ``v4``, ``v5e``, ``v5p``, ``v6e`` or ``v7x``.
    """
    if generation not in MAX_CUBES:
        return ", ".join(_LITE_2D)
    small = ("1x1x1", *_SMALL_3D) if "1x1x1" in GKE_TOPOLOGIES[generation] else _SMALL_3D
    return (f"{', '.join(small)}, and AxBxC with A <= B <= C, each a multiple of 4, of up to "
            f"{MAX_CUBES[generation]} cubes of 4x4x4 (4x4x4, 4x4x8, 4x8x8, 8x8x8, ...)")
