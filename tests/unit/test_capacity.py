"""Capacity: one value per slice, parsed strictly; each kind renders what GKE documents for its TPU pods."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import yaml

from airflow_provider_raytpu.capacity import Capacity, parse_capacities
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.raycluster import CAPACITY_TRIED_ANNOTATION, build_ray_cluster, tpu_slice_of
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator
from airflow_provider_raytpu.status.cluster import read_slices
from airflow_provider_raytpu.tasks.capacity_fallback import parse_fallback_after, resume_at
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.crd_schema import KUBERAY_VERSIONS, schema_errors

TPU_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "4x4"}

# "Consuming reserved zonal resources" (https://cloud.google.com/kubernetes-engine/docs/how-to/consuming-reservations)
# and the AI Hypercomputer page (https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom)
# select a specific reservation so, next to the accelerator's labels (here the TPU ones of "Deploy TPU workloads
# in GKE Standard"):
GKE_RESERVATION_POD = """
nodeSelector:
  cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
  cloud.google.com/gke-tpu-topology: 4x4
  cloud.google.com/reservation-name: nightly-v6e
  cloud.google.com/reservation-affinity: "specific"
"""
# A reservation shared from another project adds its project (the same page; ComputeClass
# ``reservations.specific.project`` in "About custom compute classes").
GKE_SHARED_RESERVATION_SELECTOR = {"cloud.google.com/reservation-project": "tpu-owner-1"}
# "Run a small batch workload with flex-start" (https://cloud.google.com/kubernetes-engine/docs/how-to/
# dws-flex-start-training, its TPU twin dws-flex-start-training-tpu): the Job's pod template, TPU labels for the GPU's.
GKE_FLEX_START_POD = """
nodeSelector:
  cloud.google.com/gke-flex-start: "true"
  cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
  cloud.google.com/gke-tpu-topology: 4x4
"""
# "Spot VMs" (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms): the label, and the taint a Standard
# spot pool may carry.
GKE_SPOT_POD = """
nodeSelector:
  cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
  cloud.google.com/gke-tpu-topology: 4x4
  cloud.google.com/gke-spot: "true"
tolerations:
- key: cloud.google.com/gke-spot
  operator: Equal
  value: "true"
  effect: NoSchedule
"""
TPU_TOLERATION = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}


def host_pod(capacity: str) -> dict:
    manifest = build_ray_cluster(name="nightly", namespace="ml", tpu=TpuSlice("v6e", "4x4", capacity=capacity))
    (group,) = manifest["spec"]["workerGroupSpecs"]
    return group["template"]["spec"]


@pytest.mark.parametrize(("capacity", "documented", "extra_tolerations"), [
    ("reservation:nightly-v6e", GKE_RESERVATION_POD, []),
    ("flex-start", GKE_FLEX_START_POD,
     [{"key": "cloud.google.com/gke-flex-start", "operator": "Exists", "effect": "NoSchedule"}]),
    ("spot", GKE_SPOT_POD, []),
])
def test_each_kind_renders_gkes_documented_pod_fields(capacity: str, documented: str,
                                                      extra_tolerations: list[dict]) -> None:
    pod, gke = host_pod(capacity), yaml.safe_load(documented)
    assert pod["nodeSelector"] == gke["nodeSelector"]
    assert pod["tolerations"] == [TPU_TOLERATION, *gke.get("tolerations", []), *extra_tolerations]


def test_a_shared_reservation_names_its_project_and_any_reservation_selects_the_pool_alone() -> None:
    shared = host_pod("reservation:tpu-owner-1/nightly-v6e")["nodeSelector"]
    assert shared == {**yaml.safe_load(GKE_RESERVATION_POD)["nodeSelector"], **GKE_SHARED_RESERVATION_SELECTOR}
    assert host_pod("reservation:any")["nodeSelector"] == host_pod("on-demand")["nodeSelector"] == TPU_LABELS
    assert host_pod("on-demand")["tolerations"] == [TPU_TOLERATION]


@pytest.mark.parametrize("kuberay", KUBERAY_VERSIONS)
@pytest.mark.parametrize("capacity", ["reservation:tpu-owner-1/nightly-v6e", "flex-start:24h", "spot"])
def test_every_kind_passes_the_crd_schema(capacity: str, kuberay: str) -> None:
    manifest = build_ray_cluster(name="nightly", namespace="ml", tpu=TpuSlice("v6e", "4x4", 2, capacity=capacity))
    assert schema_errors(manifest, "rayclusters", kuberay) == []


@pytest.mark.parametrize(("given", "text", "described"), [
    (None, "on-demand", "on-demand"),
    ("On-Demand", "on-demand", "on-demand"),
    (" spot ", "spot", "spot"),
    ("reservation:r1", "reservation:r1", "reservation r1"),
    ("reservation:tpu-owner-1/r1", "reservation:tpu-owner-1/r1", "reservation r1 of project tpu-owner-1"),
    ("reservation:any", "reservation:any", "any matching reservation"),
    ("flex-start", "flex-start", "flex-start"),
    ("flex-start:24h", "flex-start:1d", "flex-start, at most 1d"),
    ("flex-start:90m", "flex-start:90m", "flex-start, at most 90m"),
    ("flex-start:7d", "flex-start:7d", "flex-start, at most 7d"),
    ("None", "on-demand", "on-demand"),
])
def test_the_forms_users_write(given: object, text: str, described: str) -> None:
    capacity = Capacity.parse(given)
    assert (str(capacity), capacity.describe()) == (text, described)
    assert Capacity.parse(str(capacity)) == capacity


@pytest.mark.parametrize(("given", "says"), [
    ("reserved", "is not a capacity"),
    ("spot:yes", "is not a capacity"),
    ("reservation:", "is not a Compute Engine resource name"),
    ("reservation:Nightly", "is not a Compute Engine resource name"),
    ("reservation:x/nightly", "is not a Google Cloud project id"),
    ("flex-start:8d", "at most seven days"),
    ("flex-start:0h", "at most seven days"),
    ("flex-start:soon", "is not a duration"),
    (["reservation:r1", "spot"], "is not one capacity"),
    (True, "is not one capacity"),
])
def test_bad_values_name_the_field_the_value_and_the_forms(given: object, says: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        TpuSlice("v6e", "4x4", capacity=given)  # type: ignore[arg-type]
    assert info.value.field == "capacity" and info.value.value == given and says in str(info.value)
    assert info.value.fix.startswith("Write ")


def test_spot_true_is_spot_capacity_and_disagreeing_with_capacity_is_an_error() -> None:
    with pytest.warns(DeprecationWarning, match="write capacity='spot'"):
        assert TpuSlice("v6e", "4x4", spot="true") == TpuSlice("v6e", "4x4", capacity="spot")
    assert TpuSlice("v6e", "4x4", capacity="spot").spot is True
    with pytest.raises(InvalidInputError, match=r"spot/capacity=\(True, 'flex-start'\): ask for spot and for "
                                                r"flex-start at once. Write capacity='flex-start' alone"), \
            pytest.warns(DeprecationWarning):
        TpuSlice("v6e", "4x4", spot=True, capacity="flex-start")


def test_the_cluster_records_its_capacity_and_a_slice_recorded_before_capacity_still_reads() -> None:
    manifest = build_ray_cluster(name="n", namespace="ml", tpu=TpuSlice("v6e", "4x4", capacity="reservation:r1"))
    assert tpu_slice_of(manifest) == TpuSlice("v6e", "4x4", capacity="reservation:r1")
    recorded_by_0_2 = {"accelerator": "v6e", "topology": "4x4", "num_slices": 1, "spot": True, "chips_per_host": None}
    assert TpuSlice.from_dict(json.loads(json.dumps(recorded_by_0_2))).capacity == Capacity.parse("spot")


def test_a_literal_capacity_fails_when_the_dag_is_parsed_and_a_template_waits_for_its_value() -> None:
    with pytest.raises(InvalidInputError, match="capacity='reserve:r1'"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", capacity="reserve:r1")
    with pytest.raises(InvalidInputError, match="capacity='flex-start:2w'"):
        DeployRayServiceOperator(task_id="deploy", applications=[], accelerator="v6e", topology="4x4",
                                 capacity="flex-start:2w")
    task = CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4",
                                    capacity="{{ params.capacity }}")
    assert "capacity" in task.template_fields


def test_a_flex_start_max_run_duration_bounds_the_clusters_lifetime() -> None:
    day = timedelta(hours=24)
    assert TpuSlice("v6e", "4x4", capacity="flex-start:6h").capacity.lifetime(day) == timedelta(hours=6)
    assert TpuSlice("v6e", "4x4", capacity="flex-start:3d").capacity.lifetime(day) == day
    assert TpuSlice("v6e", "4x4", capacity="flex-start").capacity.lifetime(day) == day
    assert TpuSlice("v6e", "4x4", capacity="reservation:r1").capacity.lifetime(day) == day


@pytest.mark.parametrize(("given", "kinds"), [
    (["reservation:r1", "spot"], ("reservation:r1", "spot")),
    ("['reservation:r1', 'spot']", ("reservation:r1", "spot")),  # a list param, as a template renders it
    ("reservation:r1, flex-start:24h, spot", ("reservation:r1", "flex-start:1d", "spot")),
    ("spot", ("spot",)),
])
def test_a_list_of_capacities_to_try_in_order(given: object, kinds: tuple[str, ...]) -> None:
    assert tuple(map(str, parse_capacities(given))) == kinds


@pytest.mark.parametrize(("given", "says"), [
    ([], "lists no capacity"), (["spot", "spot"], "lists a capacity twice"), ("spot,,", "has an empty entry"),
    (["spot", "reserved"], "is not a capacity"),
])
def test_a_bad_list_names_what_is_wrong(given: object, says: str) -> None:
    with pytest.raises(InvalidInputError, match=says):
        parse_capacities(given)


def test_a_list_needs_a_window_to_fall_back_after_and_says_so_when_parsed() -> None:
    with pytest.raises(InvalidInputError, match=r"fallback_after=None: is needed when capacity lists 2 kinds "
                                                r"\(reservation:r1, spot\)"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4",
                                 capacity=["reservation:r1", "spot"])
    with pytest.raises(InvalidInputError, match="fallback_after='soon': is not a duration"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4",
                                 capacity=["reservation:r1", "spot"], fallback_after="soon")
    with pytest.raises(InvalidInputError, match="capacity='reserve:r1'"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4", capacity=["reserve:r1", "spot"],
                                 fallback_after=600)
    task = CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="4x4",
                                    capacity=["reservation:r1", "spot"], fallback_after=timedelta(minutes=20))
    assert parse_fallback_after(task.fallback_after, parse_capacities(task.capacity)) == timedelta(minutes=20)
    assert parse_fallback_after(None, parse_capacities("spot")) is None
    assert parse_fallback_after("600", parse_capacities("spot, on-demand")) == timedelta(minutes=10)


def test_a_retry_goes_on_from_the_kind_the_cluster_has_and_what_was_tried_before() -> None:
    kinds = parse_capacities(["reservation:r1", "flex-start", "spot"])
    on_flex = build_ray_cluster(name="n", namespace="ml", tpu=TpuSlice("v6e", "4x4", capacity="flex-start"))
    before = [{"capacity": "reservation:r1", "outcome": "0 of 4 TPU hosts placed in 1201 s"}]
    on_flex["metadata"]["annotations"][CAPACITY_TRIED_ANNOTATION] = json.dumps(before)
    assert resume_at(on_flex, kinds) == (1, before)
    assert resume_at(None, kinds) == (0, [])
    on_demand = build_ray_cluster(name="n", namespace="ml", tpu=TpuSlice("v6e", "4x4"))
    assert resume_at(on_demand, kinds) == (0, []), "a kind not listed (a changed DAG) starts from the first"


def test_hosts_count_as_placed_once_bound_to_a_node_and_not_while_terminating() -> None:
    def host(node: str | None, deleting: bool = False) -> dict:
        metadata = {"labels": {"ray.io/node-type": "worker", "ray.io/worker-group-replica-index": "0"},
                    **({"deletionTimestamp": "2026-12-04T00:00:00Z"} if deleting else {})}
        return {"metadata": metadata, "spec": {"nodeName": node} if node else {}, "status": {"phase": "Pending"}}

    (slice_,) = read_slices([host("gke-v6e-0"), host(None), host("gke-v6e-2", deleting=True), host("gke-v6e-3")])
    assert (slice_.hosts, slice_.scheduled_hosts, slice_.ready_hosts) == (4, 2, 0)
