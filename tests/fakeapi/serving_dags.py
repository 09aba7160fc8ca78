"""What the RayService tests deploy: the LLM application, the serving DAG's source, and a service already
serving its first version."""

from __future__ import annotations

from typing import Any

from airflow_provider_raytpu.backends.kuberay import KubeRayBackend
from airflow_provider_raytpu.hooks.raytpu import default_deployment
from airflow_provider_raytpu.manifests.raycluster import AirflowOrigin
from airflow_provider_raytpu.manifests.rayservice import build_ray_service
from airflow_provider_raytpu.tpu import TpuSlice
from tests.support.kube_connection import NAMESPACE
from tests.support.rayservice_controller import RayServiceController

SERVICES = r"/apis/ray\.io/v1/namespaces/ml/rayservices"
LLM_APP = {
    "name": "chat",
    "import_path": "ray.serve.llm:build_openai_app",
    "args": {"llm_configs": [{"model_loading_config": {"model_id": "chat-model", "model_source": "gs://b/ckpt-0"}}]},
    "version_arg": "llm_configs.0.model_loading_config.model_source",
}


def dag(dag_id: str, deploy: str | None = "", sensor: str | None = None) -> str:
    """A DAG with a deploy task (kwargs ``deploy``) and/or a sensor (kwargs ``sensor``)."""
    lines = [
        "from datetime import datetime",
        "from airflow.sdk import DAG",
        "from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator, RollbackRayServiceOperator",
        "from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor",
        f"APPS = {LLM_APP!r}",
        f"with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1),",
        "         default_args={'retries': 2, 'retry_delay': 0}, params={'version': 'gs://b/ckpt-1'}):",
    ]
    if deploy is not None:
        lines.append("    deploy = DeployRayServiceOperator(task_id='deploy', service_name='chat', "
                     "applications=[APPS], accelerator='v6e', topology='4x4', version='{{ params.version }}', "
                     + deploy + ")")
    if sensor is not None:
        version = "{{ ti.xcom_pull('deploy')['version'] }}" if deploy is not None else "{{ params.version }}"
        lines.append("    wait = RayServiceRunningSensor(task_id='wait_running', service_name='chat', "
                     f"version={version!r}, "
                     "timeout=60, poke_interval=1, " + sensor + ")")
    if deploy is not None and sensor is not None:
        lines.append("    deploy >> wait")
    return "\n".join(lines) + "\n"


def deploy_v1_running(backend: KubeRayBackend, controller: RayServiceController, dag_id: str = "serving",
                      **kwargs: Any) -> str:
    """A service already serving gs://b/ckpt-1 on RayCluster chat-old01, deployed by an earlier run of
    ``dag_id``'s deploy task (a later run of that task may promote it)."""
    backend.services.apply_service(build_ray_service(
        name="chat", namespace=NAMESPACE, tpu=TpuSlice("v6e", "4x4"), applications=[LLM_APP], version="gs://b/ckpt-1",
        origin=AirflowOrigin(dag_id, "scheduled__2026-12-01T00:00:00+00:00", "deploy", deployment=default_deployment()),
        **kwargs))
    cluster = controller.make_cluster("old01")
    controller.serving(cluster)
    return cluster
