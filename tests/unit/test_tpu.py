"""TpuSlice: derivations agree with Ray's own rules; every bad input names the value and the fix."""

from __future__ import annotations

import json

import pytest
from ray._private.accelerators import tpu as ray_tpu

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.tpu import GENERATIONS, TpuSlice, valid_topologies

# Every shape GKE offers that Ray also knows.
BOTH = [(g.name, t) for g in GENERATIONS.values() for t in sorted(g.gke_topologies & g.ray_topologies)]


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_rays_table_is_restated_as_it_is(generation: str) -> None:
    g = GENERATIONS[generation]
    assert g.ray_topologies == ray_tpu.VALID_TPU_TOPOLOGY[g.ray_version]


@pytest.mark.parametrize(("generation", "topology"), BOTH)
def test_every_gke_shape_ray_knows_derives_the_same_hosts_chips_and_resources(generation: str, topology: str) -> None:
    s = TpuSlice(generation, topology)
    ray_version = s.generation.ray_version
    assert s.chips_per_slice == ray_tpu.get_num_chips_from_topology(topology)
    assert s.host_chips == ray_tpu.get_chips_per_host(topology, ray_version)
    assert s.pod_type == ray_tpu.infer_tpu_pod_type_from_topology(topology, s.ray_accelerator_type)
    assert ray_tpu.get_total_chips_from_accelerator_type(s.pod_type) == s.chips_per_slice
    assert ray_tpu.get_num_tpu_visible_chips_per_host(s.pod_type) == s.host_chips
    assert s.hosts_per_slice * s.host_chips == s.chips_per_slice


def test_accelerator_type_is_rays_resource_name() -> None:
    from ray.util import accelerators

    assert TpuSlice("v6e", "4x4").ray_accelerator_type == accelerators.GOOGLE_TPU_V6E
    assert TpuSlice("v5e", "4x4").ray_accelerator_type == accelerators.GOOGLE_TPU_V5LITEPOD
    assert TpuSlice("v4", "2x2x2").ray_accelerator_type == accelerators.GOOGLE_TPU_V4
    assert TpuSlice("v5p", "2x2x2").ray_accelerator_type == accelerators.GOOGLE_TPU_V5P
    assert TpuSlice("v7x", "2x2x2").ray_accelerator_type == accelerators.GOOGLE_TPU_V7X


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("v6e", "v6e"), ("TPU-V6E", "v6e"), ("tpu-v6e", "v6e"), ("v5e", "v5e"), ("v5litepod", "v5e"),
     ("TPU-V5LITEPOD", "v5e"), ("v5p", "v5p"), (" V4 ", "v4"), ("v7x", "v7x"), ("TPU-V7X", "v7x")],
)
def test_generation_names_as_users_write_them(given: str, canonical: str) -> None:
    assert TpuSlice(given, "2x2x2" if canonical in ("v4", "v5p", "v7x") else "2x2").accelerator == canonical


def test_v6e_4x4_two_slices() -> None:
    s = TpuSlice("v6e", "4x4", num_slices=2, capacity="spot")
    assert (s.chips_per_slice, s.total_chips, s.host_chips, s.hosts_per_slice, s.total_hosts) == (16, 32, 4, 4, 8)
    assert s.pod_type == "v6e-16"
    assert s.head_resource == "TPU-v6e-16-head"
    assert s.node_selector == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
        "cloud.google.com/gke-spot": "true",
    }
    assert s.is_multi_host


@pytest.mark.parametrize(
    ("generation", "topology", "label"),
    [("v4", "2x2x2", "tpu-v4-podslice"), ("v5e", "2x4", "tpu-v5-lite-podslice"), ("v5p", "2x2x1", "tpu-v5p-slice"),
     ("v6e", "1x1", "tpu-v6e-slice"), ("v7x", "2x2x1", "tpu7x")],
)
def test_gke_accelerator_labels(generation: str, topology: str, label: str) -> None:
    assert TpuSlice(generation, topology).node_selector["cloud.google.com/gke-tpu-accelerator"] == label


def test_single_host_shapes_and_chips_per_host_override() -> None:
    assert (TpuSlice("v6e", "2x4").hosts_per_slice, TpuSlice("v6e", "2x4").host_chips) == (1, 8)
    two_hosts = TpuSlice("v6e", "2x4", chips_per_host=4)
    assert (two_hosts.hosts_per_slice, two_hosts.host_chips) == (2, 4)
    assert TpuSlice("v5e", "1x1").host_chips == 1
    assert TpuSlice("v4", "2x2x2").hosts_per_slice == 2
    assert TpuSlice("v6e", "2x4", chips_per_host="None").chips_per_host is None


def test_strings_from_rendered_templates_are_parsed() -> None:
    s = TpuSlice("v6e", "4x4", num_slices="2", spot="false", chips_per_host="4")
    assert (s.num_slices, s.spot, s.chips_per_host) == (2, False, 4)
    with pytest.warns(DeprecationWarning, match="TpuSlice\\(spot=True\\) is deprecated: write capacity='spot'"):
        assert TpuSlice("v6e", "4x4", spot="True").capacity.kind == "spot"


def test_json_round_trip() -> None:
    s = TpuSlice("TPU-V6E", "4x4", num_slices="2", capacity="spot")
    data = json.loads(json.dumps(s.to_dict()))
    assert TpuSlice.from_dict(data) == s
    assert data == {"accelerator": "v6e", "topology": "4x4", "num_slices": 2, "chips_per_host": None,
                    "capacity": "spot"}


def test_describe() -> None:
    assert TpuSlice("v4", "2x2x2").describe() == "v4 2x2x2 x 1 slice (2 hosts x 4 chips each, 8 chips)"
    assert TpuSlice("v6e", "2x2").describe() == "v6e 2x2 x 1 slice (1 host x 4 chips each, 4 chips)"
    assert TpuSlice("v6e", "1x1").describe() == "v6e 1x1 x 1 slice (1 host x 1 chip each, 1 chip)"


def error(**kwargs: object) -> InvalidInputError:
    fields = {"accelerator": "v6e", "topology": "4x4", **kwargs}
    with pytest.raises(InvalidInputError) as info:
        TpuSlice(**fields)  # type: ignore[arg-type]
    return info.value


def test_chip_count_as_topology_recommends_only_shapes_gke_offers() -> None:
    e = error(topology="16")
    assert e.field == "topology" and "'16'" in str(e)
    assert "topology is a slice shape such as '4x4', not a chip count" in str(e)
    assert e.fix == "Write the shape instead: 16 chips of v6e is topology '4x4'", "2x8 is no node pool GKE makes"
    assert "'2x2x2'" in str(error(accelerator="v4", topology="8"))


@pytest.mark.parametrize(("generation", "shapes"), [
    ("v5e", ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]),
    ("v6e", ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]),
])
def test_the_2d_shapes_gke_offers(generation: str, shapes: list[str]) -> None:
    """Cloud TPU's v5e and v6e tables (no 2x8, which Ray's table has)."""
    assert valid_topologies(GENERATIONS[generation]) == shapes
    assert not TpuSlice(generation, "2x8").offered_on_gke
    assert "v6e 2x8 is not a slice shape GKE offers" in TpuSlice("v6e", "2x8").not_offered()


@pytest.mark.parametrize(("generation", "topology", "hosts", "chips", "machine"), [
    ("v7x", "1x1x1", 1, 1, "tpu7x-standard-1t"),
    ("v7x", "4x4x12", 48, 4, "tpu7x-standard-4t"),
    ("v7x", "12x12x12", 432, 4, "tpu7x-standard-4t"),
    ("v5p", "4x4x28", 112, 4, "ct5p-hightpu-4t"),
    ("v5p", "16x20x28", 2240, 4, "ct5p-hightpu-4t"),
    ("v4", "8x16x16", 512, 4, "ct4p-hightpu-4t"),
    ("v4", "16x16x16", 1024, 4, "ct4p-hightpu-4t"),
    ("v6e", "1x1", 1, 1, "ct6e-standard-1t"),
    ("v6e", "2x4", 1, 8, "ct6e-standard-8t"),
    ("v6e", "4x4", 4, 4, "ct6e-standard-4t"),
    ("v5e", "2x2", 1, 4, "ct5lp-hightpu-4t"),
])
def test_shapes_gke_offers_beyond_rays_table_and_their_hosts(generation: str, topology: str, hosts: int,
                                                              chips: int, machine: str) -> None:
    s = TpuSlice(generation, topology)
    assert (s.hosts_per_slice, s.host_chips, s.machine_type.name, s.offered_on_gke) == (hosts, chips, machine, True)
    assert s.hosts_per_slice * s.host_chips == s.chips_per_slice


def test_two_4_chip_hosts_of_v6e_2x4_are_offered_on_gke() -> None:
    """Cloud TPU's v6e table: the 8-chip 2x4 attached to 2 VMs (ct6e-standard-4t), with the GKE API only."""
    two = TpuSlice("v6e", "2x4", chips_per_host=4)
    assert (two.offered_on_gke, two.machine_type.name, two.hosts_per_slice) == (True, "ct6e-standard-4t", 2)


def test_gke_label_as_accelerator() -> None:
    e = error(accelerator="tpu-v6e-slice")
    assert e.field == "accelerator" and "GKE node label" in str(e) and "accelerator='v6e'" in str(e)
    assert "accelerator='v5e'" in str(error(accelerator="tpu-v5-lite-podslice"))
    assert "accelerator='v7x'" in str(error(accelerator="tpu7x", topology="2x2x1"))


def test_pod_type_as_accelerator() -> None:
    e = error(accelerator="v6e-16")
    assert "pod type" in str(e) and "accelerator='v6e'" in str(e)


@pytest.mark.parametrize("accelerator", ["v3", "v9", "gpu", "", None, 6])
def test_unknown_generation(accelerator: object) -> None:
    e = error(accelerator=accelerator)
    assert e.field == "accelerator" and "v4, v5e, v5p, v6e, v7x" in str(e)


def test_topology_invalid_for_generation_lists_the_ones_gke_offers() -> None:
    e = error(topology="3x3")
    assert "is not a v6e slice shape" in str(e)
    assert "The shapes GKE offers of v6e: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16" in str(e)
    assert "AxBxC with A <= B <= C, each a multiple of 4, of up to 140 cubes" in str(
        error(accelerator="v5p", topology="3x3x3"))
    assert "3 dimensions" in str(error(accelerator="v4", topology="2x2"))
    assert "2 dimensions" in str(error(topology="2x2x2"))


@pytest.mark.parametrize("topology", ["4x4x", "x4", "4 by 4", "4x-4", "4.0x4", "", "4x4x4x4"])
def test_malformed_shapes(topology: str) -> None:
    e = error(topology=topology)
    assert e.field == "topology" and "'4x4'" in str(e)


def test_zero_dimension() -> None:
    assert "zero dimension" in str(error(topology="0x4"))


@pytest.mark.parametrize("num_slices", [0, -1, "0", "-2"])
def test_zero_or_negative_slices(num_slices: object) -> None:
    e = error(num_slices=num_slices)
    assert e.field == "num_slices" and "at least 1" in str(e)


@pytest.mark.parametrize("num_slices", ["two", "2.0", 2.5, True, None])
def test_slices_not_a_whole_number(num_slices: object) -> None:
    assert "not a whole number" in str(error(num_slices=num_slices))


@pytest.mark.parametrize("spot", ["yes", "1", 1, None, "tru"])
def test_spot_not_a_flag(spot: object) -> None:
    e = error(spot=spot)
    assert e.field == "spot" and "true or false" in str(e)


def test_chips_per_host_not_offered() -> None:
    e = error(topology="2x4", chips_per_host=2)
    assert e.field == "chips_per_host" and "4, 8" in str(e)
    assert "4" in error(chips_per_host=8).fix


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(InvalidInputError, match="unknown keys"):
        TpuSlice.from_dict({"accelerator": "v6e", "topology": "4x4", "chips": 16})
