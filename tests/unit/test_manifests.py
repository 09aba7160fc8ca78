"""RayCluster manifests: shape from the slice, strict CRD schema validity, names, merges, hashes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.merge import merge_fragment
from airflow_provider_raytpu.manifests.names import label_value, resource_name
from airflow_provider_raytpu.manifests.options import OPTION_NAMES, RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import (
    SPEC_HASH_ANNOTATION,
    TPU_SLICE_ANNOTATION,
    AirflowOrigin,
    build_ray_cluster,
    tpu_slice_of,
)
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.crd_schema import KUBERAY_VERSIONS, schema_errors

ORIGIN = AirflowOrigin("nightly_finetune", "scheduled__2026-12-01T00:00:00+00:00", "create_cluster")


def cluster(**kwargs: object) -> dict:
    """``build_ray_cluster`` with the cluster options given one by one, as an operator takes them."""
    options = RayClusterOptions(**{k: kwargs.pop(k) for k in OPTION_NAMES if k in kwargs})  # type: ignore[arg-type]
    args = {"name": "nightly", "namespace": "ml", "tpu": TpuSlice("v6e", "4x4", num_slices=2), "options": options}
    return build_ray_cluster(**{**args, **kwargs})  # type: ignore[arg-type]


def worker_group(manifest: dict) -> dict:
    (group,) = manifest["spec"]["workerGroupSpecs"]
    return group


SHAPES = [
    TpuSlice("v6e", "4x4", num_slices=2),
    TpuSlice("v6e", "2x4", chips_per_host=4, capacity="spot"),
    TpuSlice("v5e", "1x1"),
    TpuSlice("v4", "2x2x2"),
    TpuSlice("v5p", "4x4x4", num_slices=4),
    TpuSlice("v7x", "2x2x1"),
]


@pytest.mark.parametrize("kuberay", KUBERAY_VERSIONS)
@pytest.mark.parametrize("tpu", SHAPES, ids=TpuSlice.describe)
def test_valid_against_both_crd_versions(tpu: TpuSlice, kuberay: str) -> None:
    manifest = cluster(
        tpu=tpu,
        env={"JAX_PLATFORMS": "tpu"},
        service_account_name="ray-ksa",
        origin=ORIGIN,
        expires_at=datetime(2026, 12, 2, tzinfo=UTC),
        head_pod_template={"metadata": {"labels": {"team": "ml"}}},
        worker_pod_template={"spec": {"priorityClassName": "batch"}},
    )
    assert schema_errors(manifest, "rayclusters", kuberay) == []


@pytest.mark.parametrize("kuberay", KUBERAY_VERSIONS)
def test_schema_check_catches_unknown_fields_and_wrong_types(kuberay: str) -> None:
    bad = cluster()
    worker_group(bad)["numberOfHosts"] = 4
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "lots"
    worker_group(bad)["replicas"] = "2"
    errors = schema_errors(bad, "rayclusters", kuberay)
    assert any("numberOfHosts" in e for e in errors)
    assert any("lots" in e for e in errors)
    assert any("replicas" in e for e in errors)


def test_worker_group_follows_the_slice() -> None:
    group = worker_group(cluster())
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (2, 2, 2, 4)
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["google.com/tpu"] == "4"
    assert container["resources"]["limits"]["google.com/tpu"] == "4"
    assert group["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in group["template"]["spec"][
        "tolerations"
    ]


def test_spot_selects_spot_nodes_and_tolerates_their_taint() -> None:
    spec = worker_group(cluster(tpu=TpuSlice("v6e", "4x4", capacity="spot")))["template"]["spec"]
    assert spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert any(t["key"] == "cloud.google.com/gke-spot" for t in spec["tolerations"])


def test_head_has_no_tpu_and_exposes_the_dashboard() -> None:
    head = cluster()["spec"]["headGroupSpec"]["template"]["spec"]
    container = head["containers"][0]
    assert "google.com/tpu" not in container["resources"]["limits"]
    assert {"name": "dashboard", "containerPort": 8265} in container["ports"]
    assert "nodeSelector" not in head


def test_metadata_records_origin_slice_and_expiry() -> None:
    manifest = cluster(origin=ORIGIN, expires_at=datetime(2026, 12, 3, 6, tzinfo=UTC))
    labels, notes = manifest["metadata"]["labels"], manifest["metadata"]["annotations"]
    assert labels["app.kubernetes.io/managed-by"] == "airflow-provider-raytpu"
    assert labels["raytpu.dev/run-id"] == "scheduled__2026-12-01T00-00-00-00-00"
    assert notes["raytpu.dev/run-id"] == ORIGIN.run_id
    assert notes["raytpu.dev/expires-at"] == "2026-12-03T06:00:00Z"
    assert json.loads(notes[TPU_SLICE_ANNOTATION])["topology"] == "4x4"
    assert tpu_slice_of(manifest) == TpuSlice("v6e", "4x4", num_slices=2)


def test_spec_hash_ignores_run_metadata_but_not_the_spec() -> None:
    first = cluster(origin=ORIGIN, expires_at=datetime(2026, 12, 3, tzinfo=UTC))
    retry = cluster(origin=AirflowOrigin("d", "other-run", "t"), expires_at=datetime(2027, 1, 1, tzinfo=UTC))
    other_shape = cluster(tpu=TpuSlice("v6e", "4x8", num_slices=2))
    hash_of = lambda m: m["metadata"]["annotations"][SPEC_HASH_ANNOTATION]  # noqa: E731
    assert hash_of(first) == hash_of(retry)
    assert hash_of(first) != hash_of(other_shape)
    assert hash_of(first) != hash_of(cluster(image="rayproject/ray:2.61.0-py311-tpu"))


def test_ray_version_from_the_image_tag() -> None:
    assert cluster()["spec"]["rayVersion"] == "2.60.0"
    assert "rayVersion" not in cluster(image="registry.local:5000/ray:latest")["spec"]
    assert cluster(image="ray", ray_version="2.55.1")["spec"]["rayVersion"] == "2.55.1"


def test_user_fragments_merge_by_name() -> None:
    manifest = cluster(
        env={"A": "1"},
        worker_pod_template={
            "spec": {
                "containers": [
                    {"name": "ray-worker", "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
                    {"name": "sidecar", "image": "busybox"},
                ],
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            }
        },
    )
    spec = worker_group(manifest)["template"]["spec"]
    worker, sidecar = spec["containers"]
    # KubeRay's v6e multi-host samples' env first (the shape is two v6e 4x4 slices), the slice count GKE's
    # TPU webhook looks for, then the user's, merged by name.
    assert [var["name"] for var in worker["env"][:5]] == [
        "NODE_IP", "VBAR_CONTROL_SERVICE_URL", "JAX_PLATFORMS", "ENABLE_PJRT_COMPATIBILITY", "MEGASCALE_NUM_SLICES"]
    assert worker["env"][5:] == [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]
    assert worker["resources"]["limits"]["google.com/tpu"] == "4"
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert [t["key"] for t in spec["tolerations"]] == ["google.com/tpu", "dedicated"]


def test_hosts_of_several_slices_carry_the_slice_count_the_tpu_webhook_needs() -> None:
    def host(tpu: TpuSlice, env: dict[str, str] | None = None) -> dict:
        manifest = build_ray_cluster(name="n", namespace="ml", tpu=tpu, options=RayClusterOptions(env=env))
        return worker_group(manifest)["template"]["spec"]["containers"][0]

    for tpu in (TpuSlice("v4", "2x2x2", num_slices=2), TpuSlice("v5litepod", "2x2", num_slices=3)):
        worker = host(tpu)
        assert {"name": "MEGASCALE_NUM_SLICES", "value": str(tpu.num_slices)} in worker["env"], tpu
        assert worker["ports"] == [{"name": "mxla", "containerPort": 8081}]
    one = host(TpuSlice("v4", "2x2x2"))
    assert "MEGASCALE_NUM_SLICES" not in {var["name"] for var in one["env"]} and "ports" not in one
    # The user's value wins, once.
    given = host(TpuSlice("v4", "2x2x2", num_slices=2), env={"MEGASCALE_NUM_SLICES": "2"})
    assert [var for var in given["env"] if var["name"] == "MEGASCALE_NUM_SLICES"] == [
        {"name": "MEGASCALE_NUM_SLICES", "value": "2"}]


def test_merge_fragment_is_pure_and_deletes_with_none() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    merged = merge_fragment(base, {"a": {"c": [3]}, "d": None})
    assert merged == {"a": {"b": 1, "c": [3]}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}


@pytest.mark.parametrize(
    ("given", "expected"),
    [("nightly_finetune", "nightly-finetune"), ("Nightly.Run 1", "nightly-run-1"), ("-a_", "a")],
)
def test_names_are_normalised(given: str, expected: str) -> None:
    assert resource_name(given, "cluster_name") == expected


def test_long_names_keep_a_hash_and_stay_stable() -> None:
    long = "nightly_embeddings_for_the_whole_catalogue_" + "x" * 40
    name = resource_name(long, "cluster_name")
    assert len(name) == 53 and name == resource_name(long, "cluster_name")
    assert name != resource_name(long + "y", "cluster_name")
    assert len(resource_name(long, "name", limit=47)) <= 47


@pytest.mark.parametrize("bad", ["nightly/run", "ü-cluster", "", "___"])
def test_names_that_cannot_be_fixed_are_rejected_with_the_rule(bad: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        build_ray_cluster(name=bad, namespace="ml", tpu=TpuSlice("v6e", "4x4"))
    assert info.value.field == "cluster_name"


def test_label_values_are_valid() -> None:
    value = label_value("manual__2026-12-02T16:16:44.977558+00:00" * 3)
    assert len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()


def test_tpu_hosts_are_sized_from_their_machine_type_and_the_users_env_wins() -> None:
    from airflow_provider_raytpu.manifests.options import RayClusterOptions
    from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
    from airflow_provider_raytpu.tpu import TpuSlice

    def host(tpu: TpuSlice, **options: Any) -> dict[str, Any]:
        manifest = build_ray_cluster(name="c", namespace="ml", tpu=tpu, options=RayClusterOptions(**options))
        return worker_group(manifest)["template"]["spec"]["containers"][0]

    assert host(TpuSlice("v6e", "2x4"))["resources"]["limits"] == {  # ct6e-standard-8t: 360 vCPU, 1440 GB
        "cpu": "270", "memory": "1080G", "google.com/tpu": "8"}
    assert host(TpuSlice("v5e", "4x4"))["resources"]["limits"]["cpu"] == "84"  # ct5lp-hightpu-4t: 112 vCPU
    assert host(TpuSlice("v6e", "4x4"), worker_resources={"cpu": "24", "memory": "200G"})["resources"]["limits"] == {
        "cpu": "24", "memory": "200G", "google.com/tpu": "4"}
    own = host(TpuSlice("v6e", "4x4"), env={"JAX_PLATFORMS": "tpu"})["env"]
    assert [var["name"] for var in own].count("JAX_PLATFORMS") == 1
    assert {"name": "JAX_PLATFORMS", "value": "tpu"} in own
    single = host(TpuSlice("v6e", "2x2"))
    assert "ports" not in single and single["env"] == [], "the samples set no runtime env on a single host"


@pytest.mark.parametrize(("tpu", "accelerator", "hosts", "limits"), [
    # tpu7x-standard-1t: 1 chip, 56 vCPU, 240 GB; a single-host slice of one host.
    (TpuSlice("v7x", "1x1x1"), "tpu7x", 1, {"cpu": "42", "memory": "180G", "google.com/tpu": "1"}),
    # ct5p-hightpu-4t: 4 chips, 208 vCPU, 448 GB; 448 chips are 112 hosts.
    (TpuSlice("v5p", "4x4x28"), "tpu-v5p-slice", 112, {"cpu": "156", "memory": "336G", "google.com/tpu": "4"}),
], ids=["v7x-1x1x1", "v5p-4x4x28"])
def test_shapes_only_gke_offers_render_with_their_hosts_and_machine_type(
        tpu: TpuSlice, accelerator: str, hosts: int, limits: dict[str, str]) -> None:
    manifest = cluster(tpu=tpu)
    group = worker_group(manifest)
    spec = group["template"]["spec"]
    assert (group["numOfHosts"], group["replicas"]) == (hosts, 1)
    assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                    "cloud.google.com/gke-tpu-topology": tpu.topology}
    assert spec["containers"][0]["resources"]["limits"] == limits
    for kuberay in KUBERAY_VERSIONS:
        assert schema_errors(manifest, "rayclusters", kuberay) == []
