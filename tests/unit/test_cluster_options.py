"""RayClusterOptions: one value for the pod and cluster options of both operators and both builders."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.options import (
    DEFAULT_IMAGE,
    OPTION_NAMES,
    RayClusterOptions,
    take_cluster_options,
)
from airflow_provider_raytpu.manifests.raycluster import SPEC_HASH_ANNOTATION, AirflowOrigin, build_ray_cluster
from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.tpu import TpuSlice

ORIGIN = AirflowOrigin("nightly_finetune", "scheduled__2026-12-01T00:00:00+00:00", "create_cluster")
EVERY_OPTION = RayClusterOptions(
    image="rayproject/ray:2.60.0-py311-tpu",
    ray_version="2.60.0",
    head_resources={"cpu": 4, "memory": "16Gi"},
    worker_resources={"cpu": "24", "memory": "96Gi"},
    env={"JAX_PLATFORMS": "tpu", "B": "1"},
    head_ray_start_params={"num-cpus": 0},
    worker_ray_start_params={"object-store-memory": 10**9},
    service_account_name="ray-ksa",
    labels={"team": "ml"},
    annotations={"owner": "ml-platform"},
    head_pod_template={"metadata": {"labels": {"team": "ml"}}},
    worker_pod_template={"spec": {"priorityClassName": "batch",
                                  "containers": [{"name": "ray-worker",
                                                  "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
                                  "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}},
    override_tpu_placement=True,  # allowed, not used: the template above leaves the TPU placement alone
)
LLM_APP = {"name": "chat", "import_path": "ray.serve.llm:build_openai_app",
           "args": {"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "gs://b/m"}}]},
           "version_arg": "llm_configs.0.model_loading_config.model_source"}


def spec_hash_of(manifest: dict[str, Any]) -> str:
    return manifest["metadata"]["annotations"][SPEC_HASH_ANNOTATION]


# The spec hashes of fa61dc7 (before the options became one value) and of release 0.1. A RayCluster or
# RayService made by an older release must be adopted by a retry after an upgrade: change these only with a
# migration (since 0.2: TPU hosts sized from their machine type, the v6e multi-host env and port, a multi-slice
# host's MEGASCALE_NUM_SLICES and DCN port; an object of 0.1 is adopted through raytpu.dev/also-adopts).
RELEASE_0_1 = ("7c81c600dd7c5c47", "855b4184db9badf7", "a28bd3cc63774e34", "0dd9b3b369449bb9")


def test_objects_of_release_0_1_are_adopted() -> None:
    from airflow_provider_raytpu.backends.apply import same_service, same_spec
    from airflow_provider_raytpu.manifests.raycluster import ALSO_ADOPTS_ANNOTATION

    two_spot = TpuSlice("v6e", "4x4", num_slices=2, capacity="spot")
    manifests = [
        build_ray_cluster(name="nightly", namespace="ml", tpu=TpuSlice("v6e", "4x4")),
        build_ray_cluster(name="nightly", namespace="ml", tpu=two_spot, options=EVERY_OPTION, origin=ORIGIN,
                          expires_at=datetime(2026, 12, 2, tzinfo=UTC)),
        build_ray_service(name="chat", namespace="ml", tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP],
                          version="gs://b/ckpt-1"),
        build_ray_service(name="chat", namespace="ml", tpu=two_spot, applications=[LLM_APP], version="gs://b/ckpt-1",
                          options=EVERY_OPTION, origin=ORIGIN, cluster_deletion_delay_seconds=120),
    ]
    for manifest, old_hash in zip(manifests, RELEASE_0_1, strict=True):
        made_by_0_1 = copy.deepcopy(manifest)
        notes = made_by_0_1["metadata"]["annotations"]
        notes.pop(ALSO_ADOPTS_ANNOTATION, None)
        notes[SPEC_HASH_ANNOTATION] = old_hash
        same = same_service if manifest["kind"] == "RayService" else same_spec
        assert same(made_by_0_1, manifest), f"a {manifest['kind']} of release 0.1 ({old_hash}) is adopted"
        notes[SPEC_HASH_ANNOTATION] = "0123456789abcdef"
        assert not same(made_by_0_1, manifest)


def test_spec_hashes_are_pinned_for_fixed_inputs() -> None:
    two_spot = TpuSlice("v6e", "4x4", num_slices=2, capacity="spot")
    assert spec_hash_of(build_ray_cluster(name="nightly", namespace="ml", tpu=TpuSlice("v6e", "4x4"))) == (
        "351ef3bcc80ab58f")
    assert spec_hash_of(build_ray_cluster(name="nightly", namespace="ml", tpu=two_spot, options=EVERY_OPTION,
                                          origin=ORIGIN, expires_at=datetime(2026, 12, 2, tzinfo=UTC))) == (
        "3258fe37337239bf")
    assert spec_hash_of(build_ray_service(name="chat", namespace="ml", tpu=TpuSlice("v6e", "4x4"),
                                          applications=[LLM_APP], version="gs://b/ckpt-1")) == "63e4e6bb56e4b6fc"
    assert spec_hash_of(build_ray_service(name="chat", namespace="ml", tpu=two_spot, applications=[LLM_APP],
                                          version="gs://b/ckpt-1", options=EVERY_OPTION, origin=ORIGIN,
                                          cluster_deletion_delay_seconds=120)) == "7bd6c6baba320ef0"


def test_flat_options_move_into_one_dict_and_other_arguments_stay() -> None:
    arguments: dict[str, Any] = {"image": "ray:x", "env": {"A": "1"}, "task_id": "create", "retries": 2}
    options = take_cluster_options(RayClusterOptions(worker_resources={"cpu": "4"}), arguments)
    assert options == {"worker_resources": {"cpu": "4"}, "image": "ray:x", "env": {"A": "1"}}
    assert arguments == {"task_id": "create", "retries": 2}
    assert take_cluster_options(None, {}) == {}
    assert take_cluster_options({"labels": {"team": "ml"}}, {}) == {"labels": {"team": "ml"}}
    assert take_cluster_options("{{ params.cluster_options }}", {}) == "{{ params.cluster_options }}"


def test_to_dict_keeps_what_differs_from_the_defaults_and_round_trips() -> None:
    assert RayClusterOptions().to_dict() == {}
    assert RayClusterOptions(image=DEFAULT_IMAGE, env={"A": "1"}).to_dict() == {"env": {"A": "1"}}
    assert RayClusterOptions.from_value(EVERY_OPTION.to_dict()) == EVERY_OPTION
    assert set(EVERY_OPTION.to_dict()) == set(OPTION_NAMES) - {"image"}  # its image is the default


@pytest.mark.parametrize(
    ("cluster_options", "arguments", "field", "text"),
    [
        ({"image": "ray:a"}, {"image": "ray:b"}, "image", "is given both as a keyword argument and in cluster_options"),
        (RayClusterOptions(env={"A": "1"}), {"env": {"A": "2"}}, "env", "is given both"),
        ("{{ params.cluster_options }}", {"env": {"A": "1"}}, "cluster_options", "is a template, so env cannot"),
        ({"imagee": "ray:a"}, {}, "cluster_options", "are not cluster options"),
        (["ray:a"], {}, "cluster_options", "is not a dict of cluster options"),
    ],
)
def test_options_given_twice_or_unknown_are_refused_when_the_dag_is_parsed(
        cluster_options: Any, arguments: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        take_cluster_options(cluster_options, arguments)
    assert info.value.field == field and text in str(info.value)


@pytest.mark.parametrize(
    ("value", "field", "text"),
    [
        ({"image": ""}, "image", "is not an image reference"),
        ({"ray_version": 2.6}, "ray_version", "is not a string"),
        ({"worker_resources": "{'cpu': '8'}"}, "worker_resources", "render_template_as_native_obj=True"),
        ({"env": ["A=1"]}, "env", "is not a mapping"),
        ({"env": {"A=B": "x"}}, "env", "'A=B': is not an environment variable name"),
        ({"env": {"1ST": "x"}}, "env", "not starting with a digit"),
        ({"labels": {"app.kubernetes.io/managed-by": "me"}}, "labels['app.kubernetes.io/managed-by']",
         "is the label this provider finds its own objects by"),
        ({"annotations": {"raytpu.dev/map-index": "0"}}, "annotations['raytpu.dev/map-index']",
         "is under 'raytpu.dev/', where this provider records an object's owner"),
        ({"labels": {"ray.io/originated-from-cr-name": "chat"}}, "labels['ray.io/originated-from-cr-name']",
         "is under 'ray.io/', which KubeRay reads and writes"),
        ({"worker_group": "x"}, "cluster_options", "are not cluster options"),
        ("{'image': 'ray:a'}", "cluster_options", "render_template_as_native_obj=True"),
    ],
)
def test_rendered_options_of_the_wrong_type_name_the_field_and_the_fix(value: Any, field: str, text: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        RayClusterOptions.from_value(value)
    assert info.value.field == field and text in str(info.value)


def test_a_reserved_key_written_literally_fails_when_the_dag_is_parsed() -> None:
    from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

    with pytest.raises(InvalidInputError, match="Write annotations of your own"):
        CreateRayClusterOperator(task_id="create", accelerator="v6e", topology="2x2",
                                 cluster_options={"annotations": {"raytpu.dev/also-adopts": "[]"}})
    kept = RayClusterOptions(labels={"kueue.x-k8s.io/queue-name": "tpu", "team": "ml"},
                             annotations={"example.com/note": "ray.io/x"})  # Kueue's and others' keys are the user's
    assert kept.labels == {"kueue.x-k8s.io/queue-name": "tpu", "team": "ml"}


def test_both_operators_take_the_options_as_one_value_and_the_older_flat_spelling_warns() -> None:
    from airflow.exceptions import AirflowProviderDeprecationWarning
    from airflow.sdk import DAG

    from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator
    from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator

    slice_args = {"accelerator": "v6e", "topology": "4x4"}
    service_args = {**slice_args, "applications": [LLM_APP], "version": "v1"}
    with DAG("options", schedule=None, default_args={"cluster_options": {"labels": {"team": "ml"}}}):
        with pytest.warns(AirflowProviderDeprecationWarning, match=r"Cluster options as keyword arguments \(image, "
                          r"env\) are deprecated: give them in cluster_options, e.g. cluster_options=\{'image': ...\}"):
            flat = CreateRayClusterOperator(task_id="flat", image="ray:x", env={"A": "{{ run_id }}"}, **slice_args)
        whole = CreateRayClusterOperator(task_id="whole", cluster_options=RayClusterOptions(
            image="ray:x", env={"A": "{{ run_id }}"}), **slice_args)
        with pytest.warns(AirflowProviderDeprecationWarning, match=r"\(worker_resources\) are deprecated"):
            deploy = DeployRayServiceOperator(task_id="deploy", worker_resources={"cpu": "{{ params.cpu }}"},
                                              **service_args)
        canary = DeployRayServiceOperator(task_id="canary", cluster_options={"service_account_name": "ray-ksa"},
                                          **service_args)
    # default_args give cluster_options (not flat option names: they are not __init__ parameters).
    assert flat.cluster_options == {"labels": {"team": "ml"}, "image": "ray:x", "env": {"A": "{{ run_id }}"}}
    assert whole.cluster_options == {"image": "ray:x", "env": {"A": "{{ run_id }}"}}
    assert deploy.cluster_options == {"labels": {"team": "ml"}, "worker_resources": {"cpu": "{{ params.cpu }}"}}
    assert canary.cluster_options == {"service_account_name": "ray-ksa"}, "a task's own value replaces default_args'"
    for operator in (flat, deploy):
        assert "cluster_options" in operator.template_fields
        assert not set(OPTION_NAMES) & set(operator.template_fields), "one rule: the options are templated as one"


@pytest.mark.parametrize(("fragment", "changed"), [
    ({"spec": {"nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2"}}},
     "nodeSelector['cloud.google.com/gke-tpu-topology']: '4x4' -> '2x2'"),
    ({"spec": {"nodeSelector": None}}, "nodeSelector['cloud.google.com/gke-tpu-accelerator']: 'tpu-v6e-slice' -> None"),
    ({"spec": {"tolerations": None}}, "toleration 'google.com/tpu' (NoSchedule) dropped or changed"),
    ({"spec": {"tolerations": [{"key": "google.com/tpu", "operator": "Equal", "value": "v5p"}]}},
     "toleration 'google.com/tpu' (NoSchedule) dropped or changed"),
    ({"spec": {"containers": [{"name": "ray-worker", "resources": {"limits": {"google.com/tpu": "1"}}}]}},
     "ray-worker/limits google.com/tpu: '4' -> '1'"),
    ({"spec": {"containers": [{"name": "sidecar", "resources": {"requests": {"google.com/tpu": "4"}}}]}},
     "sidecar/requests google.com/tpu: None -> '4'"),
], ids=["topology", "no-selectors", "no-toleration", "other-toleration", "fewer-chips", "chips-elsewhere"])
def test_a_worker_template_that_moves_the_tpu_hosts_is_refused_unless_the_task_opts_in(
        fragment: dict[str, Any], changed: str) -> None:
    tpu = TpuSlice("v6e", "4x4")
    with pytest.raises(InvalidInputError) as info:
        build_ray_cluster(name="train", namespace="ml", tpu=tpu,
                          options=RayClusterOptions(worker_pod_template=fragment))
    assert info.value.field == "worker_pod_template" and changed in str(info.value)
    assert "set override_tpu_placement=True" in str(info.value)
    cluster = build_ray_cluster(name="train", namespace="ml", tpu=tpu, options=RayClusterOptions(
        worker_pod_template=fragment, override_tpu_placement=True))
    assert changed in json.loads(cluster["metadata"]["annotations"]["raytpu.dev/tpu-placement-overridden"])


def test_a_worker_template_that_adds_to_the_placement_is_the_users_own() -> None:
    added = {"spec": {"nodeSelector": {"topology.kubernetes.io/zone": "us-east5-b"},
                      "tolerations": [{"key": "team", "operator": "Exists", "effect": "NoSchedule"}],
                      "containers": [{"name": "sidecar", "image": "busybox"}]}}
    cluster = build_ray_cluster(name="train", namespace="ml", tpu=TpuSlice("v6e", "4x4"),
                                options=RayClusterOptions(worker_pod_template=added))
    assert "raytpu.dev/tpu-placement-overridden" not in cluster["metadata"]["annotations"]
