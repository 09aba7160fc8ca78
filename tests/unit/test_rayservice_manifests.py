"""RayService manifests: serve config from the slice, the one-slice preflight, versions, CRD schema validity."""

from __future__ import annotations

import json

import pytest
import yaml

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.options import OPTION_NAMES, RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import (
    SPEC_HASH_ANNOTATION,
    AirflowOrigin,
    build_ray_cluster,
    spec_hash,
)
from airflow_provider_raytpu.manifests.rayservice import (
    MODEL_VERSION_ANNOTATION,
    UPDATE_ANNOTATION,
    VERSION_HISTORY_ANNOTATION,
    build_ray_service,
    cluster_version,
    next_history,
    ray_cluster_of,
    rollback_target,
    service_version,
    version_history,
)
from airflow_provider_raytpu.manifests.serve_preflight import serve_config_problems
from airflow_provider_raytpu.manifests.serveconfig import (
    ServeApplication,
    build_serve_config,
    parse_serve_config,
)
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.crd_schema import KUBERAY_VERSIONS, schema_errors

V6E_4X4 = TpuSlice("v6e", "4x4")
ORIGIN = AirflowOrigin("serve_chat", "manual__2026-12-01T00:00:00+00:00", "deploy")


def llm_app(**llm_config: object) -> dict:
    return {
        "name": "chat",
        "import_path": "ray.serve.llm:build_openai_app",
        "args": {"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "gs://b/m"},
                                  **llm_config}]},
        "version_arg": "llm_configs.0.model_loading_config.model_source",
    }


def plain_app(**deployment: object) -> dict:
    return {"name": "model", "import_path": "my_models.serve:build_app", "args": {"size": 2},
            "version_arg": "checkpoint_uri", "deployments": [{"name": "Model", **deployment}]}


def service(**kwargs: object) -> dict:
    """``build_ray_service`` with the cluster options given one by one, as an operator takes them."""
    kwargs["options"] = RayClusterOptions(**{k: kwargs.pop(k) for k in OPTION_NAMES if k in kwargs})  # type: ignore[arg-type]
    args = {"name": "chat", "namespace": "ml", "tpu": V6E_4X4, "applications": [llm_app()], "version": "gs://b/ckpt-1"}
    return build_ray_service(**{**args, **kwargs})  # type: ignore[arg-type]


def serve_config(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


# -- rendering --------------------------------------------------------------------------------


SHAPES = [TpuSlice("v6e", "4x4"), TpuSlice("v6e", "2x4", chips_per_host=4, capacity="spot"), TpuSlice("v5e", "1x1"),
          TpuSlice("v4", "2x2x2"), TpuSlice("v5p", "4x4x4", num_slices=2), TpuSlice("v7x", "2x2x1")]


@pytest.mark.parametrize("kuberay", KUBERAY_VERSIONS)
@pytest.mark.parametrize("tpu", SHAPES, ids=TpuSlice.describe)
def test_valid_against_both_crd_versions(tpu: TpuSlice, kuberay: str) -> None:
    first = service(tpu=tpu, origin=ORIGIN, env={"JAX_PLATFORMS": "tpu"}, service_account_name="ray-ksa",
                    labels={"team": "ml"}, annotations={"owner": "ml-platform"}, cluster_deletion_delay_seconds=120,
                    serve_options={"proxy_location": "EveryNode", "http_options": {"request_timeout_s": 60}},
                    head_pod_template={"metadata": {"labels": {"team": "ml"}}},
                    worker_pod_template={"spec": {"priorityClassName": "serving"}},
                    applications=[llm_app(), plain_app(num_replicas=1, max_surge_percent=100)])
    promoted = service(tpu=tpu, current=first, version="gs://b/ckpt-2", origin=ORIGIN)
    in_place = service(tpu=tpu, current=promoted, version="gs://b/ckpt-3", in_place=True, upgrade_strategy="None")
    for manifest in (first, promoted, in_place):
        assert schema_errors(manifest, "rayservices", kuberay) == []


@pytest.mark.parametrize("kuberay", KUBERAY_VERSIONS)
def test_schema_check_catches_unknown_fields(kuberay: str) -> None:
    bad = service()
    bad["spec"]["serveConfig"] = "applications: []"
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["numberOfHosts"] = 4
    bad["spec"]["upgradeStrategy"]["type"] = 3
    errors = schema_errors(bad, "rayservices", kuberay)
    assert any("serveConfig'" in e for e in errors)
    assert any("numberOfHosts" in e for e in errors)
    assert any("upgradeStrategy/type" in e for e in errors)


def test_cluster_config_is_the_raycluster_spec_plus_the_version() -> None:
    manifest = service(image="rayproject/ray:2.60.0-py311-tpu")
    cluster = build_ray_cluster(name="chat", namespace="ml", tpu=V6E_4X4,
                                options=RayClusterOptions(image="rayproject/ray:2.60.0-py311-tpu"))
    config = manifest["spec"]["rayClusterConfig"]
    for template in (config["headGroupSpec"]["template"], config["workerGroupSpecs"][0]["template"]):
        assert template["metadata"]["annotations"] == {MODEL_VERSION_ANNOTATION: "gs://b/ckpt-1"}
        template.pop("metadata")
    assert config == cluster["spec"]
    assert config["workerGroupSpecs"][0]["numOfHosts"] == 4
    assert manifest["spec"]["upgradeStrategy"] == {"type": "NewCluster"}


def test_llm_fields_come_from_the_slice_and_the_version_goes_to_version_arg() -> None:
    (app,) = serve_config(service())["applications"]
    (config,) = app["args"]["llm_configs"]
    assert config["accelerator_type"] == "TPU-V6E"
    assert config["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    assert config["model_loading_config"]["model_source"] == "gs://b/ckpt-1"
    assert app["import_path"] == "ray.serve.llm:build_openai_app" and app["route_prefix"] == "/"
    assert "version_arg" not in app
    v5e = serve_config(service(tpu=TpuSlice("v5e", "4x4")))["applications"][0]["args"]["llm_configs"][0]
    assert v5e["accelerator_type"] == "TPU-V5LITEPOD"


def test_llm_fields_the_user_set_to_the_slice_are_kept() -> None:
    app = llm_app(accelerator_type="TPU-V6E", accelerator_config={"kind": "tpu", "topology": "4X4"})
    config = serve_config(service(applications=[app]))["applications"][0]["args"]["llm_configs"][0]
    assert config["accelerator_config"] == {"kind": "tpu", "topology": "4X4"}


def test_other_llm_builders_and_single_host_slices() -> None:
    pd = {"name": "pd", "import_path": "ray.serve.llm:build_pd_openai_app",
          "args": {"prefill_config": {"model_loading_config": {"model_id": "m"}},
                   "decode_config": {"model_loading_config": {"model_id": "m"}}}}
    built = build_serve_config([pd], V6E_4X4).config["applications"][0]["args"]
    assert built["prefill_config"]["accelerator_config"]["topology"] == "4x4"
    assert built["decode_config"]["accelerator_config"]["topology"] == "4x4"
    # One host: a per-chip fallback cannot span slices, so an explicit topology-less config is fine.
    single = llm_app(accelerator_config={"kind": "tpu"})
    assert build_serve_config([single], TpuSlice("v6e", "2x4"), version="v1").config


def test_serve_config_is_stable_yaml() -> None:
    first, again = service(), service()
    assert first["spec"]["serveConfigV2"] == again["spec"]["serveConfigV2"]
    assert (first["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
            == again["metadata"]["annotations"][SPEC_HASH_ANNOTATION])
    assert parse_serve_config(first["spec"]["serveConfigV2"]) == serve_config(first)
    assert parse_serve_config("") == {} and parse_serve_config(": :") == {}


def test_names_fit_rayservice_limits() -> None:
    manifest = service(name="Nightly_Chat_Model_" + "x" * 60)
    assert len(manifest["metadata"]["name"]) <= 47
    assert manifest["metadata"]["name"] == service(name="Nightly_Chat_Model_" + "x" * 60)["metadata"]["name"]
    with pytest.raises(InvalidInputError, match="service_name"):
        service(name="chat/1")


def test_serve_application_objects_and_options() -> None:
    app = ServeApplication("model", "my_models.serve:build_app", route_prefix="/m", args={"a": 1},
                           runtime_env={"pip": ["x"]}, version_arg="nested.uri")
    config = build_serve_config([app], V6E_4X4, version="v9", options={"proxy_location": "EveryNode"}).config
    assert config["proxy_location"] == "EveryNode"
    assert config["applications"][0] == {"name": "model", "route_prefix": "/m",
                                         "import_path": "my_models.serve:build_app",
                                         "runtime_env": {"pip": ["x"]}, "args": {"a": 1, "nested": {"uri": "v9"}}}


# -- versions -----------------------------------------------------------------------------------


def test_version_annotations_and_history() -> None:
    first = service(origin=ORIGIN)
    notes = first["metadata"]["annotations"]
    assert notes[MODEL_VERSION_ANNOTATION] == "gs://b/ckpt-1"
    assert json.loads(notes[VERSION_HISTORY_ANNOTATION]) == ["gs://b/ckpt-1"]
    assert notes[UPDATE_ANNOTATION] == "created"
    assert notes["raytpu.dev/run-id"] == ORIGIN.run_id
    second = service(current=first, version="gs://b/ckpt-2")
    assert version_history(second) == ["gs://b/ckpt-1", "gs://b/ckpt-2"]
    assert second["metadata"]["annotations"][UPDATE_ANNOTATION] == "new-cluster"
    assert cluster_version({"spec": second["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-2"
    again = service(current=second, version="gs://b/ckpt-2")
    assert version_history(again) == version_history(second)
    assert again["spec"] == second["spec"]
    assert rollback_target(second) == "gs://b/ckpt-1"
    back = service(current=second, version=rollback_target(second))
    assert version_history(back) == ["gs://b/ckpt-1", "gs://b/ckpt-2", "gs://b/ckpt-1"]
    assert rollback_target(back) == "gs://b/ckpt-2"  # rolling back twice toggles, like kubectl rollout undo
    with pytest.raises(InvalidInputError, match="no earlier version"):
        rollback_target(first)


def test_history_is_bounded_newest_last() -> None:
    history: list[str] = []
    for step in range(25):
        history = next_history(history, f"v{step}")
    assert history == [f"v{step}" for step in range(15, 25)]
    assert next_history(["a", "b"], "b") == ["a", "b"]


def test_in_place_changes_only_the_serve_config() -> None:
    first = service()
    in_place = service(current=first, version="gs://b/ckpt-2", in_place=True)
    assert in_place["spec"]["rayClusterConfig"] == first["spec"]["rayClusterConfig"]
    assert in_place["spec"]["serveConfigV2"] != first["spec"]["serveConfigV2"]
    assert service_version(in_place) == "gs://b/ckpt-2"
    assert cluster_version({"spec": in_place["spec"]["rayClusterConfig"]}) == "gs://b/ckpt-1"
    assert in_place["metadata"]["annotations"][UPDATE_ANNOTATION] == "in-place"
    # A change of the Serve config only (same version) is in-place too: KubeRay applies it on the running cluster.
    edited = service(current=first, applications=[llm_app(engine_kwargs={"max_model_len": 2048})])
    assert edited["metadata"]["annotations"][UPDATE_ANNOTATION] == "in-place"


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({"version": None}, "version", "is not a model version"),
        ({"version": "  "}, "version", "is not a model version"),
        ({"version": "None"}, "version", "is not a model version"),
        ({"upgrade_strategy": "Rolling"}, "upgrade_strategy", "is not a KubeRay v1.5 upgrade strategy"),
        ({"upgrade_strategy": "None"}, "upgrade_strategy", "makes KubeRay ignore rayClusterConfig changes"),
        ({"applications": []}, "applications", "is empty"),
        ({"applications": [{"name": "a"}]}, "applications[0].import_path", "is required"),
        ({"applications": [{"name": "a", "import_path": "m:f", "replicas": 2}]}, "applications[0]", "are not fields"),
        ({"applications": [plain_app(), plain_app()]}, "applications['model'].name", "is used by two applications"),
        ({"applications": [{"name": "a", "import_path": "m f"}]}, "applications['a'].import_path",
         "is not an import path"),
        ({"applications": [{"name": "a", "import_path": "m:f", "route_prefix": "api"}]},
         "applications['a'].route_prefix", "is not an HTTP route"),
        ({"applications": [{"name": "a", "import_path": "m:f", "args": {"l": [1]}, "version_arg": "l.3"}]},
         "applications['a'].version_arg", "indexes '3' into a list of 1 items"),
        ({"serve_options": {"applications": []}}, "serve_options", "contains applications"),
    ],
)
def test_bad_service_input_is_refused(kwargs: dict, field: str, text: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        service(**kwargs)
    assert info.value.field == field and text in str(info.value)


# -- preflight: a replica must land on ONE slice ---------------------------------------------------

SPREAD = {"placement_group_strategy": "STRICT_SPREAD"}
PREFLIGHT = [
    # (id, applications, slice, field, message fragments)
    ("llm-without-topology-on-multi-host", [llm_app(accelerator_config={"kind": "tpu"})], V6E_4X4,
     "applications['chat'].args.llm_configs[0].accelerator_config",
     ["has no topology, but a v6e 4x4 slice has 4 hosts", "span two slices",
      "Write accelerator_config={'kind': 'tpu', 'topology': '4x4'}"]),
    ("llm-topology-disagrees", [llm_app(accelerator_config={"kind": "tpu", "topology": "2x4"})], V6E_4X4,
     "applications['chat'].args.llm_configs[0].accelerator_config.topology",
     ["disagrees with the RayService's slice (v6e 4x4", "Write topology='4x4'"]),
    ("llm-accelerator-disagrees", [llm_app(accelerator_type="TPU-V5P")], V6E_4X4,
     "applications['chat'].args.llm_configs[0].accelerator_type",
     ["Ray accelerator type is TPU-V6E", "Write accelerator_type='TPU-V6E'"]),
    ("llm-gpu-kind", [llm_app(accelerator_config={"kind": "gpu"})], V6E_4X4,
     "applications['chat'].args.llm_configs[0].accelerator_config", ["has kind 'gpu'", "runs on a TPU slice"]),
    ("llm-config-file-on-multi-host",
     [{"name": "chat", "import_path": "ray.serve.llm:build_openai_app", "args": {"llm_configs": ["/c/m.yaml"]}}],
     V6E_4X4, "applications['chat'].args.llm_configs[0]", ["is not an inline LLMConfig", "Write the LLMConfig inline"]),
    ("llm-without-configs", [{"name": "chat", "import_path": "ray.serve.llm:build_openai_app", "args": {}}],
     V6E_4X4, "applications['chat'].args", ["has no LLMConfig"]),
    ("deployment-more-chips-than-a-host", [plain_app(ray_actor_options={"resources": {"TPU": 16}})], V6E_4X4,
     "applications['model'].deployments['Model'].ray_actor_options",
     ["asks for 16 TPU chips per replica, but one host of a v6e 4x4 slice has 4 chips",
      "placement_group_bundles=[{'TPU': 4}] * 4, placement_group_strategy='STRICT_SPREAD'"]),
    ("deployment-num-tpus", [plain_app(ray_actor_options={"num_tpus": 8})], V6E_4X4,
     "applications['model'].deployments['Model'].ray_actor_options", ["asks for 8 TPU chips per replica",
                                                                      "[{'TPU': 4}] * 2"]),
    ("bundles-without-strategy", [plain_app(placement_group_bundles=[{"TPU": 4}] * 4)], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_strategy",
     ["is missing, but the bundles hold 16 TPU chips", "Write placement_group_strategy='STRICT_SPREAD'"]),
    ("strategy-without-bundles", [plain_app(**SPREAD)], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_strategy",
     ["is given without placement_group_bundles"]),
    ("strict-pack-across-hosts",
     [plain_app(placement_group_bundles=[{"TPU": 4}] * 4, placement_group_strategy="STRICT_PACK")], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_strategy", ["puts every bundle on one host"]),
    ("unknown-strategy", [plain_app(placement_group_bundles=[{"TPU": 4}] * 4, placement_group_strategy="ALL")],
     V6E_4X4, "applications['model'].deployments['Model'].placement_group_strategy", ["is not a placement strategy"]),
    ("bundle-larger-than-a-host", [plain_app(placement_group_bundles=[{"TPU": 8}] * 2, **SPREAD)], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_bundles",
     ["has a bundle of 8 TPU chips", "so no host can hold it"]),
    ("actor-larger-than-first-bundle",
     [plain_app(ray_actor_options={"resources": {"TPU": 16}}, placement_group_bundles=[{"TPU": 4}] * 4, **SPREAD)],
     V6E_4X4, "applications['model'].deployments['Model'].ray_actor_options",
     ["places the replica actor in the first placement-group bundle, which has 4"]),
    ("bundles-span-slices", [plain_app(placement_group_bundles=[{"TPU": 4}] * 8, **SPREAD)],
     TpuSlice("v6e", "4x4", num_slices=2), "applications['model'].deployments['Model'].placement_group_bundles",
     ["hold 32 TPU chips, more than one v6e 4x4 slice (16 chips)", "span slices"]),
    ("bundles-not-a-list", [plain_app(placement_group_bundles={"TPU": 4}, **SPREAD)], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_bundles", ["is not a non-empty list"]),
    ("bundle-tpu-not-a-number", [plain_app(placement_group_bundles=[{"TPU": "four"}], **SPREAD)], V6E_4X4,
     "applications['model'].deployments['Model'].placement_group_bundles", ["is not a number"]),
]


@pytest.mark.parametrize(("applications", "tpu", "field", "fragments"), [p[1:] for p in PREFLIGHT],
                         ids=[p[0] for p in PREFLIGHT])
def test_preflight_refuses_replicas_that_cannot_land_on_one_slice(applications: list, tpu: TpuSlice, field: str,
                                                                  fragments: list[str]) -> None:
    with pytest.raises(InvalidInputError) as info:
        service(applications=applications, tpu=tpu)
    assert info.value.field == field
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "app",
    [
        plain_app(ray_actor_options={"resources": {"TPU": 4}}),
        plain_app(ray_actor_options={"resources": {"TPU": 4}}, placement_group_bundles=[{"TPU": 4}] * 4, **SPREAD),
        plain_app(placement_group_bundles=[{"TPU": 4, "CPU": 1}] * 4, placement_group_strategy="SPREAD"),
        plain_app(placement_group_bundles=[{"CPU": 1}], placement_group_strategy="STRICT_PACK"),
        plain_app(num_replicas=2, ray_actor_options={"num_cpus": 0.1}),
        llm_app(accelerator_config={"kind": "tpu", "topology": "4x4"}, accelerator_type="TPU-V6E"),
    ],
    ids=["one-host", "bundles-per-host", "spread", "cpu-only-bundle", "cpu-only", "llm-explicit"],
)
def test_preflight_accepts_what_fits_on_one_slice(app: dict) -> None:
    assert service(applications=[app])["spec"]["serveConfigV2"]


def test_problems_of_a_foreign_config_are_all_listed() -> None:
    config = {"applications": [
        {"name": "chat", "import_path": "ray.serve.llm:build_openai_app",
         "args": {"llm_configs": [{"accelerator_config": {"kind": "tpu"}}]}},
        {"name": "model", "import_path": "m:f",
         "deployments": [{"name": "M", "ray_actor_options": {"resources": {"TPU": 64}}}]},
    ]}
    problems = serve_config_problems(config, V6E_4X4)
    assert [p.field for p in problems] == ["applications['chat'].args.llm_configs[0].accelerator_config",
                                           "applications['model'].deployments['M'].ray_actor_options"]


def test_local_cluster_manifest_has_no_version() -> None:
    manifest = service(head_pod_template={"metadata": {"labels": {"team": "ml"}}})
    cluster = ray_cluster_of(manifest, "chat-local")
    assert cluster["kind"] == "RayCluster" and cluster["metadata"]["name"] == "chat-local"
    head = cluster["spec"]["headGroupSpec"]["template"]
    assert head["metadata"] == {"labels": {"team": "ml"}}
    assert "metadata" not in cluster["spec"]["workerGroupSpecs"][0]["template"]
    assert cluster["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == spec_hash(cluster["spec"])
    promoted = service(current=manifest, version="gs://b/ckpt-2",
                       head_pod_template={"metadata": {"labels": {"team": "ml"}}})
    assert ray_cluster_of(promoted, "chat-local") == cluster
    for kuberay in KUBERAY_VERSIONS:
        assert schema_errors(cluster, "rayclusters", kuberay) == []
