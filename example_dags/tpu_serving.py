"""Serve models on TPU slices: deploy or promote a RayService, wait until the new version answers.

``tpu_model_serving`` serves the small JAX/Flax model of ``serving/model.py`` (runs on the
local backend too). Trigger it with ``{"version": "v2"}`` to promote: the version goes into
the cluster config, so KubeRay prepares a fresh slice and switches traffic once it serves;
``{"rollback": true}`` goes back to the previous version. In a training DAG the version is
the checkpoint the training task returned, e.g. ``"{{ ti.xcom_pull('train')['checkpoint_uri'] }}"``.

``tpu_llm_serving`` serves an LLM with Ray Serve LLM (vLLM) on one v6e 4x4 slice (4 hosts):
``accelerator_type`` and ``accelerator_config: {kind: tpu, topology: 4x4}`` are written from
the slice, so the replica is gang-scheduled onto ONE slice (GKE only: it needs a vLLM TPU image).

Locally the Ray workers import ``serving.model`` from ``PYTHONPATH``; on GKE put the
``serving`` package in the image, or ship it with ``runtime_env={"py_modules": ["gs://..."]}``.
"""

from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator
from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

EXAMPLES_DIR = str(Path(__file__).resolve().parent)

TINY_MODEL = [
    {
        "name": "tiny-model",
        "import_path": "serving.model:build_app",
        "route_prefix": "/",
        "version_arg": "model_version",
        "deployments": [
            {
                "name": "TinyModel",
                "num_replicas": 1,
                "max_surge_percent": 100,  # new replicas start before old ones stop
                "ray_actor_options": {"num_cpus": 0.1},
            }
        ],
    }
]

with DAG(
    "tpu_model_serving",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    max_active_runs=1,
    params={"version": Param("v1", type="string"), "rollback": Param(False, type="boolean")},
):
    deploy = DeployRayServiceOperator(
        task_id="deploy",
        service_name="tiny-model",
        applications=TINY_MODEL,
        accelerator="v6e",
        topology="2x4",
        chips_per_host=4,  # two 4-chip hosts: a multi-host slice
        version="{{ params.version }}",
        rollback="{{ params.rollback }}",
        cluster_options={"env": {"PYTHONPATH": EXAMPLES_DIR}},
    )
    wait = RayServiceRunningSensor(
        task_id="wait_running",
        service=deploy.output,
        deploying_timeout=900,
        smoke_request={"path": "/", "method": "POST", "json": {"inputs": [[0.1, 0.2, 0.3, 0.4]]}},
    )
    deploy >> wait


LLM = [
    {
        "name": "llm",
        "import_path": "ray.serve.llm:build_openai_app",
        "args": {
            "llm_configs": [
                {
                    "model_loading_config": {"model_id": "chat", "model_source": "gs://my-bucket/checkpoints/chat"},
                    "engine_kwargs": {"tensor_parallel_size": 16, "max_model_len": 4096},
                }
            ]
        },
        "version_arg": "llm_configs.0.model_loading_config.model_source",
    }
]

with DAG(
    "tpu_llm_serving",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    max_active_runs=1,
    params={"checkpoint": Param("gs://my-bucket/checkpoints/chat/step-1000", type="string")},
):
    deploy_llm = DeployRayServiceOperator(
        task_id="deploy",
        service_name="chat",
        applications=LLM,
        accelerator="v6e",
        topology="4x4",
        version="{{ params.checkpoint }}",
        cluster_options={"image": "rayproject/ray-llm:2.60.0-py311-tpu"},
    )
    wait_llm = RayServiceRunningSensor(
        task_id="wait_running",
        service=deploy_llm.output,
        deploying_timeout=1800,
        smoke_request={
            "path": "/v1/chat/completions",
            "method": "POST",
            "json": {"model": "chat", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
        },
    )
    deploy_llm >> wait_llm
