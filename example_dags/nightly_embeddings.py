"""Nightly batch embedding on a TPU slice: a small JAX model, one actor per TPU host, parquet to GCS.

create cluster -> wait until every host is ready -> Ray Data embedding (the model loads
once per actor; each actor holds a whole TPU host) -> write parquet -> delete the cluster
as a teardown. Re-running a day replaces that day's output, so retries never duplicate rows.
The default is the smallest slice with more than one host (v4 2x2x2), so the one-actor-per-host
pool shows; one run at a time, since a rerun of a date replaces that date's output.
"""

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.ray_data import RayDataOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

with DAG(
    "nightly_embeddings",
    schedule="@daily",
    start_date=datetime(2026, 12, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=30)},
    params={
        "accelerator": Param("v4", type="string", description="TPU generation: v4, v5e, v5p, v6e, v7x"),
        "topology": Param("2x2x2", type="string", description="slice shape, e.g. 4x4 (never a chip count)"),
        "slices": Param("1", type=["string", "integer"]),
        "capacity": Param("spot", type="string",
                           description="GKE capacity: on-demand, spot, reservation:<name> or flex-start"),
        "storage": Param("gs://raytpu-demo", type="string"),
    },
    tags=["raytpu", "tpu", "embeddings"],
):
    create = CreateRayClusterOperator(
        task_id="create_cluster",
        accelerator="{{ params.accelerator }}",
        topology="{{ params.topology }}",
        num_slices="{{ params.slices }}",
        capacity="{{ params.capacity }}",
    )
    ready = RayClusterReadySensor(task_id="wait_cluster_ready", cluster=create.output, timeout=3600, poke_interval=2)
    embed = RayDataOperator(
        task_id="embed",
        cluster=create.output,
        input_uri="{{ params.storage }}/raw/rows.jsonl",
        output_uri="{{ params.storage }}/embeddings/{{ ds }}",
        transform="pipeline.transforms:Embedder",
        actor_per_tpu_host=True,
        runtime_env={"py_modules": [str(Path(__file__).resolve().parent / "pipeline")]},
        poll_interval=1,
    )
    delete = DeleteRayClusterOperator(task_id="delete_cluster")
    create >> ready >> embed >> delete.as_teardown(setups=[create, ready])
