"""Create a RayCluster on TPU slices, wait until every host of every slice is ready, always tear it down.

The default is one v6e 2x2 slice (one host); trigger it with params for a bigger shape.
"""

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG(
    "tpu_cluster_lifecycle",
    schedule="@daily",
    start_date=datetime(2026, 12, 1),
    catchup=False,
    params={"accelerator": Param("v6e"), "topology": Param("2x2"), "slices": Param(1, type="integer")},
):
    create = CreateRayClusterOperator(
        task_id="create_cluster",
        accelerator="{{ params.accelerator }}",
        topology="{{ params.topology }}",
        num_slices="{{ params.slices }}",
    )
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, timeout=1800)
    delete = DeleteRayClusterOperator(task_id="delete_cluster")
    create >> ready >> delete.as_teardown(setups=[create, ready])
