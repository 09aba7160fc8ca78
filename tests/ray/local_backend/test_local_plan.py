"""The local backend's pure parts: the manifest -> local Ray nodes plan, and label selectors (no process is
started)."""

from __future__ import annotations

import pytest

from airflow_provider_raytpu.backends.local.plan import plan_cluster
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import TPU_LABELS

pytestmark = pytest.mark.ray


def test_the_plan_gives_each_host_what_a_gke_tpu_host_gets() -> None:
    """Pure: the manifest -> local Ray nodes mapping, for two slices (no process is started)."""
    manifest = build_ray_cluster(name="two", namespace="default", tpu=TpuSlice("v4", "2x2x2", num_slices=2),
                                 options=RayClusterOptions(env={"FOO": "bar", "JAX_PLATFORMS": "tpu"},
                                                           head_resources={"cpu": "4"}))
    plan = plan_cluster(manifest, 8)
    assert plan.slice_names == ("two-slice-0", "two-slice-1") and plan.total_hosts == 4
    assert plan.head.num_cpus == 1 and plan.head.env["FOO"] == "bar" and not plan.head.resources
    for index, hosts in enumerate(plan.slices):
        for worker_id, host in enumerate(hosts):
            head_resource = {"TPU-v4-16-head": 1.0} if worker_id == 0 else {}
            assert host.resources == {"TPU": 4.0, f"two-slice-{index}": 1.0, "accelerator_type:TPU-V4": 1.0,
                                      **head_resource}
            assert host.labels == {"ray.io/tpu-slice-name": f"two-slice-{index}",
                                   "ray.io/tpu-worker-id": str(worker_id), **{k: v for k, v in TPU_LABELS.items()
                                                                             if k != "ray.io/tpu-slice-name"}}
            # The manifest's slice count, and what GKE's TPU webhook adds for it.
            assert host.env == {"FOO": "bar", "TPU_NAME": f"two-slice-{index}", "TPU_WORKER_ID": str(worker_id),
                                "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2", "JAX_PLATFORMS": "cpu",
                                "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": str(index),
                                "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1", "MEGASCALE_PORT": "8081"}
            assert host.num_cpus == 1


def test_label_selectors_follow_kubernetes() -> None:
    from airflow_provider_raytpu.backends.local.selectors import selector_matches

    labels = {"app.kubernetes.io/managed-by": "airflow-provider-raytpu", "tier": "gold"}
    assert selector_matches(labels, "")
    assert selector_matches(labels, "app.kubernetes.io/managed-by=airflow-provider-raytpu,tier")
    assert selector_matches(labels, "tier in (gold, silver),!missing,tier!=bronze")
    assert not selector_matches(labels, "tier notin (gold)")
    assert not selector_matches(labels, "tier==silver")
    assert not selector_matches(labels, "missing in (x)")
