"""Our rendered KubeRay manifests against the real API server's CRD schemas.

``dryRun=All`` + ``fieldValidation=Strict``: the API server decodes, validates and
defaults the object exactly as for a real create (so an unknown field is an error,
not silently pruned), and stores nothing. Each answer must also still contain every
field we sent, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin, build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import Connections, rayclusters

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

ORIGIN = AirflowOrigin("nightly_train", "scheduled__2026-12-01T00:00:00+00:00", "create_cluster")

# Pod-template fragments a user passes to CreateRayClusterOperator: GCS FUSE, shared
# memory, a secret, priority, an init container, security context, extra selectors.
WORKER_FRAGMENT = {
    "metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}, "labels": {"team": "ml"}},
    "spec": {
        "priorityClassName": "tpu-training",
        "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
        "nodeSelector": {"cloud.google.com/gke-nodepool": "tpu-pool"},
        "imagePullSecrets": [{"name": "registry"}],
        "initContainers": [{"name": "warmup", "image": "busybox:1.37", "command": ["sh", "-c", "true"]}],
        "containers": [{
            "name": "ray-worker",
            "env": [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/cache"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "checkpoints", "mountPath": "/ckpt"}],
            "securityContext": {"privileged": False, "capabilities": {"add": ["IPC_LOCK"]}},
        }],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
            {"name": "checkpoints", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                            "volumeAttributes": {"bucketName": "ckpts",
                                                                 "mountOptions": "implicit-dirs"}}},
        ],
    },
}
HEAD_FRAGMENT = {
    "metadata": {"labels": {"team": "ml"}},
    "spec": {
        "nodeSelector": {"cloud.google.com/gke-nodepool": "cpu-pool"},
        "containers": [{"name": "ray-head", "readinessProbe": {"httpGet": {"path": "/api/gcs_healthz", "port": 8265},
                                                                  "periodSeconds": 5}}],
    },
}

SHAPES = {
    "v6e-4x4x2-spot": dict(tpu=TpuSlice("v6e", "4x4", num_slices=2, capacity="spot")),
    "v5e-2x4-4chips": dict(tpu=TpuSlice("v5e", "2x4", chips_per_host=4)),
    "v4-2x2x2": dict(tpu=TpuSlice("v4", "2x2x2")),
    "v5p-4x4x4": dict(tpu=TpuSlice("v5p", "4x4x4", num_slices=2)),
    "v7x-2x2x1": dict(tpu=TpuSlice("v7x", "2x2x1")),
    "v6e-4x4-with-fragments": dict(
        tpu=TpuSlice("v6e", "4x4"), options=RayClusterOptions(
            worker_pod_template=WORKER_FRAGMENT, head_pod_template=HEAD_FRAGMENT,
            env={"RAY_memory_monitor_refresh_ms": "0"}, service_account_name="ray-workload",
            head_ray_start_params={"num-cpus": 0}, worker_ray_start_params={"object-store-memory": 10**9},
            labels={"cost-center": "research"}, annotations={"example.com/owner": "ml-platform"},
            head_resources={"cpu": "4", "memory": "16Gi"}, worker_resources={"cpu": "100", "memory": "400Gi"},
        ),
    ),
    "v5p-2x2x1-fragments": dict(tpu=TpuSlice("v5p", "2x2x1", num_slices=3, capacity="spot"),
                                options=RayClusterOptions(worker_pod_template=WORKER_FRAGMENT)),
}


def missing_or_changed(sent: Any, stored: Any, path: str = "") -> list[str]:
    """Paths of ``sent`` that ``stored`` lacks or holds differently (defaults added by the server are fine)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [f"{path}: {stored!r}"]
        return [p for k, v in sent.items()
                for p in (missing_or_changed(v, stored[k], f"{path}.{k}") if k in stored else [f"{path}.{k} pruned"])]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [f"{path}: {len(sent)} items sent, {stored!r} stored"]
        return [p for i, (a, b) in enumerate(zip(sent, stored, strict=True))
                for p in missing_or_changed(a, b, f"{path}[{i}]")]
    return [] if sent == stored else [f"{path}: sent {sent!r}, stored {stored!r}"]


@pytest.fixture(scope="module")
def custom_objects(k8s_control_plane: ControlPlane) -> Iterator[Any]:
    from kubernetes import client

    with k8s_control_plane.api_client() as api:
        yield client.CustomObjectsApi(api)


def dry_run_create(custom_objects: Any, namespace: str, manifest: dict[str, Any], plural: str) -> dict[str, Any]:
    return custom_objects.create_namespaced_custom_object(
        "ray.io", "v1", namespace, plural, manifest, dry_run="All", field_validation="Strict")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ray_cluster_is_accepted_strictly_and_kept_whole(custom_objects: Any, namespace: str, shape: str,
                                                         k8s_control_plane: ControlPlane) -> None:
    manifest = build_ray_cluster(name=f"dry-{shape}", namespace=namespace, origin=ORIGIN,
                                 expires_at=datetime.now(UTC) + timedelta(hours=2), **SHAPES[shape])
    stored = dry_run_create(custom_objects, namespace, manifest, "rayclusters")
    assert missing_or_changed(manifest, stored) == []
    group = stored["spec"]["workerGroupSpecs"][0]
    tpu = SHAPES[shape]["tpu"]
    assert (group["replicas"], group["numOfHosts"]) == (tpu.num_slices, tpu.hosts_per_slice)
    # Dry run: nothing stored.
    assert [rc["metadata"]["name"] for rc in rayclusters(k8s_control_plane, namespace)] == []


def test_an_unknown_field_is_refused_not_pruned(custom_objects: Any, namespace: str,
                                                k8s_control_plane: ControlPlane,
                                                connections: Connections) -> None:
    """The control: this server does enforce Strict on our CRDs, down inside pod templates;
    and through the provider a typo in a user's fragment is a clear, non-retried error."""
    from kubernetes.client.rest import ApiException

    from airflow_provider_raytpu.errors import FatalError
    from airflow_provider_raytpu.hooks.raytpu import RayTpuHook

    typo = {"spec": {"nodeSelecter": {"cloud.google.com/gke-nodepool": "tpu-pool"}}}
    manifest = build_ray_cluster(name="typo", namespace=namespace, tpu=TpuSlice("v6e", "4x4"),
                                 options=RayClusterOptions(worker_pod_template=typo))
    with pytest.raises(ApiException) as refused:
        dry_run_create(custom_objects, namespace, manifest, "rayclusters")
    assert refused.value.status == 400
    message = json.loads(refused.value.body)["message"]
    assert 'strict decoding error: unknown field "spec.workerGroupSpecs[0].template.spec.nodeSelecter"' in message

    connections.as_admin()
    with pytest.raises(FatalError) as error:
        RayTpuHook().backend.apply_cluster(manifest)
    assert f"refused to create rayclusters.ray.io in namespace '{namespace}'" in str(error.value)
    assert "nodeSelecter" in str(error.value)
    assert rayclusters(k8s_control_plane, namespace) == []


def test_ray_service_is_accepted_strictly_and_kept_whole(custom_objects: Any, namespace: str) -> None:
    from airflow_provider_raytpu.manifests.rayservice import build_ray_service

    llm = {"name": "chat", "import_path": "ray.serve.llm:build_openai_app",
           "args": {"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "gs://b/m"}}]},
           "version_arg": "llm_configs.0.model_loading_config.model_source"}
    for name, tpu, kwargs in [
        ("chat-v6e", TpuSlice("v6e", "4x4"), {"options": RayClusterOptions(worker_pod_template=WORKER_FRAGMENT),
                                              "cluster_deletion_delay_seconds": 30}),
        ("chat-v5e", TpuSlice("v5e", "2x4", chips_per_host=4), {}),
    ]:
        manifest = build_ray_service(name=name, namespace=namespace, tpu=tpu, applications=[llm],
                                     version="gs://b/ckpt-1", origin=ORIGIN, **kwargs)
        stored = dry_run_create(custom_objects, namespace, manifest, "rayservices")
        assert missing_or_changed(manifest, stored) == [], name
