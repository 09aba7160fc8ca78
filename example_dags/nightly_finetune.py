"""Nightly fine-tuning on a TPU slice, then promotion of the served model to the new checkpoint.

create cluster -> wait until every host of every slice is ready -> preprocess (Ray Data)
-> fine-tune (JaxTrainer, orbax checkpoints in GCS, resumes after a retry or a lost host)
-> promote the RayService to the new checkpoint -> wait until it serves it, with a smoke
request -> the training cluster is deleted as a teardown, whatever happened -> the run report
(chip-hours, cost, preemptions, throughput and a PNG timeline) is written next to the checkpoints.

Runs unchanged on the local backend (``make demo``) and, by connection only, on GKE.
Trigger it from the UI to choose the slice; the params arrive as strings and are parsed
strictly. The default is the smallest multi-host slice (v4 2x2x2: 2 hosts), so unpausing
it does not start an expensive run. ``model_version`` serves an existing checkpoint
instead of the new one. Every later task takes the cluster reference ``create.output``;
``create`` and the ready sensor are setups of the teardown, so clearing ``train`` after the
teardown ran re-creates the cluster, waits for it, and trains again. One run at a time:
runs promote the same RayService.
"""

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, Param

from airflow_provider_raytpu.operators.jax_trainer import JaxTrainerOperator
from airflow_provider_raytpu.operators.ray_data import RayDataOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.operators.rayservice import DeployRayServiceOperator
from airflow_provider_raytpu.operators.run_report import RunReportOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor
from airflow_provider_raytpu.sensors.rayservice import RayServiceRunningSensor

EXAMPLES = Path(__file__).resolve().parent
SHIP_PIPELINE = {"py_modules": [str(EXAMPLES / "pipeline")]}
# What a run leaves for other DAGs: after_promotion.py is scheduled on the served model.
CHECKPOINTS = Asset("finetuned_regressor_checkpoints")
SERVED_MODEL = Asset("finetuned_regressor")

with DAG(
    "nightly_finetune",
    schedule="@daily",
    start_date=datetime(2026, 12, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    params={
        "accelerator": Param("v4", type="string", description="TPU generation: v4, v5e, v5p, v6e, v7x"),
        "topology": Param("2x2x2", type="string", description="slice shape, e.g. 4x4 (never a chip count)"),
        "slices": Param("1", type=["string", "integer"]),
        "capacity": Param("on-demand", type="string",
                           description="GKE capacity: on-demand, spot, reservation:<name> or flex-start"),
        "serve_accelerator": Param("v6e", type="string"),
        "serve_topology": Param("2x2", type="string"),
        "storage": Param("gs://raytpu-demo", type="string", description="bucket (and prefix) for data and checkpoints"),
        "total_steps": Param(30, type="integer"),
        "model_version": Param("", type="string", description="serve this checkpoint instead of the new one"),
    },
    tags=["raytpu", "tpu", "training"],
):
    create = CreateRayClusterOperator(
        task_id="create_cluster",
        accelerator="{{ params.accelerator }}",
        topology="{{ params.topology }}",
        num_slices="{{ params.slices }}",
        capacity="{{ params.capacity }}",
    )
    ready = RayClusterReadySensor(task_id="wait_cluster_ready", cluster=create.output, timeout=3600, poke_interval=2)
    preprocess = RayDataOperator(
        task_id="preprocess",
        cluster=create.output,
        input_uri="{{ params.storage }}/raw/rows.jsonl",
        output_uri="{{ params.storage }}/features/{{ ds }}",
        transform="pipeline.transforms:normalise",
        runtime_env=SHIP_PIPELINE,
        poll_interval=1,
    )
    train = JaxTrainerOperator(
        task_id="train",
        cluster=create.output,
        train_loop="pipeline.train_loop:train_loop_per_worker",
        checkpoint_uri="{{ params.storage }}/checkpoints",
        datasets={"eval": "{{ ti.xcom_pull('preprocess')['output_uri'] }}"},
        config={"total_steps": "{{ params.total_steps }}", "checkpoint_every": 5, "eval_dataset": "eval"},
        batch_size=32,
        ragged_policy="pad",
        max_failures=3,
        runtime_env=SHIP_PIPELINE,
        poll_interval=1,
        outlets=[CHECKPOINTS],  # its event: checkpoint_uri, checkpoint_step, run_name, training_attempts
    )
    # No XCom needed: it deletes what this run's create task made (also when create failed after applying).
    delete = DeleteRayClusterOperator(task_id="delete_cluster")
    promote = DeployRayServiceOperator(
        task_id="promote_model",
        service_name="finetuned-regressor",
        accelerator="{{ params.serve_accelerator }}",
        topology="{{ params.serve_topology }}",
        version="{{ params.model_version or ti.xcom_pull('train')['checkpoint_uri'] }}",
        applications=[
            {
                "name": "regressor",
                "import_path": "pipeline.serve:build_app",
                "route_prefix": "/",
                "version_arg": "checkpoint_uri",
                "deployments": [{"name": "Regressor", "num_replicas": 1, "max_surge_percent": 100}],
            }
        ],
        # Locally the Serve replicas import `pipeline` from here; on GKE bake it into the image.
        cluster_options={"env": {"PYTHONPATH": str(EXAMPLES)}},
    )
    serving = RayServiceRunningSensor(
        task_id="wait_serving",
        service=promote.output,
        deploying_timeout=900,
        poke_interval=2,
        smoke_request={"path": "/", "method": "POST", "json": {"inputs": [[0.5, -0.2, 0.1, 0.3, 0.0, 0.2, -0.1, 0.4]]}},
        outlets=[SERVED_MODEL],  # its event: service, served_version; after_promotion.py is scheduled on it
    )
    # Last, and a teardown too: it runs whatever happened and leaves the run's state to the tasks above.
    report = RunReportOperator(task_id="run_report", report_uri="{{ params.storage }}/reports")
    create >> ready >> preprocess >> train >> delete.as_teardown(setups=[create, ready])
    train >> promote >> serving
    [delete, serving] >> report.as_teardown()
