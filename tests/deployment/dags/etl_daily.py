"""Two DAGs whose ids differ only in ``_`` vs ``.``, scheduled once for the same logical date.

Each creates a small cluster, waits until it is ready and deletes it as a teardown.
"""

from datetime import datetime

from airflow.sdk import DAG

from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

CLUSTER = "{{ ti.xcom_pull('create_cluster')['cluster_name'] }}"

for dag_id in ("etl_daily", "etl.daily"):
    with DAG(dag_id, schedule="@once", start_date=datetime(2026, 11, 1), catchup=False):
        create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v4", topology="2x2x1")
        ready = RayClusterReadySensor(task_id="wait_ready", cluster_name=CLUSTER, timeout=600, poke_interval=1)
        delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=CLUSTER)
        create >> ready >> delete.as_teardown(setups=create)
