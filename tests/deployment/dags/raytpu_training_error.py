"""A JaxTrainer run whose train loop raises at step 0: the example loop given a learning rate it cannot read
(``"fast"``). The training task defers, so its failure goes through the triggerer's event and
``execute_complete``; tests/deployment/test_training.py reads its log as the UI does.
"""

from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

PIPELINE = Path(__file__).resolve().parents[3] / "example_dags" / "pipeline"
CLUSTER = "{{ ti.xcom_pull('create_cluster')['cluster_name'] }}"

with DAG(
    "raytpu_training_error",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    params={"storage": Param("gs://raytpu-test", type="string")},
):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v4", topology="2x2x1")
    ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=CLUSTER, timeout=600, poke_interval=1)
    train = JaxTrainerOperator(
        task_id="train",
        cluster_name=CLUSTER,
        train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri="{{ params.storage }}/checkpoints",
        config={"total_steps": 4, "learning_rate": "fast"},
        max_failures=0,
        runtime_env={"py_modules": [str(PIPELINE)]},
        deferrable=True,
        poll_interval=1,
    )
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=CLUSTER)
    create >> ready >> train >> delete.as_teardown(setups=create)
