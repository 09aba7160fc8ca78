"""A short JaxTrainer run on a small slice. Unlike the example DAGs, only ``create`` is the
teardown's setup, so clearing ``train`` re-creates the cluster but not the ready sensor: the
training task itself must wait until the new cluster is READY.
With ``cluster_gate`` the cluster's nodes wait for that file (``tests/deployment/site``).
"""

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

PIPELINE = Path(__file__).resolve().parents[3] / "example_dags" / "pipeline"
CLUSTER = "{{ ti.xcom_pull('create_cluster')['cluster_name'] }}"

with DAG(
    "raytpu_training",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5)},
    params={
        "storage": Param("gs://raytpu-test", type="string"),
        "cluster_gate": Param("", type="string", description="the cluster's nodes start once this file exists"),
    },
):
    create = CreateRayClusterOperator(
        task_id="create_cluster",
        accelerator="v4",
        topology="2x2x1",
        cluster_options={"env": {"RAYTPU_TEST_CLUSTER_GATE": "{{ params.cluster_gate }}"}},
    )
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=CLUSTER, timeout=600, poke_interval=1)
    train = JaxTrainerOperator(
        task_id="train",
        cluster_name=CLUSTER,
        train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri="{{ params.storage }}/checkpoints",
        config={"total_steps": 4, "checkpoint_every": 2},
        max_failures=0,
        runtime_env={"py_modules": [str(PIPELINE)]},
        poll_interval=1,
    )
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=CLUSTER)
    create >> ready >> train >> delete.as_teardown(setups=create)
