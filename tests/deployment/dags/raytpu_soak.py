"""The fault soak's DAG: a cluster on the ``raytpu_soak`` connection (backend kubernetes: a Kubernetes API
and its service proxy that the test runs), two ticking Ray jobs (one followed in the triggerer, one in a
worker) and one that fails after three lines, each with a secret in its ``--config``, and a teardown
that deletes the run's cluster: by the literal name when the run has one, else found by its owner.

``cluster_name`` (a param) is empty for a name of the run's own, or a literal name two runs share.
"""

import json
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

SECRET = "sk-soak-7f3e9a2b4c6d8e0f"
CONFIG = ["--config", json.dumps({"wandb_api_key": SECRET, "steps": 40})]
# Prints a numbered tick every half second, 40 in all.
TICKER = (
    "import sys, time\n"
    "for tick in range(1, 41):\n"
    "    print(f'tick {tick:04d}', flush=True)\n"
    "    time.sleep(0.5)\n"
    "print('ticked 40 times', flush=True)\n"
)
FAILS_EARLY = "import sys\nprint('loading', flush=True)\nprint('step 1', flush=True)\nsys.exit('boom')\n"
CONNECTION = {"raytpu_conn_id": "raytpu_soak"}

with DAG(
    "raytpu_soak",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    max_active_runs=2,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=2)},
    params={"cluster_name": Param("", type="string", description="empty: a name of this run's own")},
):
    create = CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2",
                                      cluster_name="{{ params.cluster_name }}", **CONNECTION)
    ready = RayClusterReadySensor(task_id="wait_ready", cluster=create.output, deferrable=True, timeout=300,
                                  poke_interval=1)
    followed = [
        SubmitRayJobOperator(task_id=task_id, cluster=create.output, entrypoint=["python", "-c", TICKER, *CONFIG],
                             ship_provider=False, deferrable=deferrable, poll_interval=1)
        for task_id, deferrable in (("job", True), ("sync_job", False))
    ]
    failing = SubmitRayJobOperator(task_id="failing_job", cluster=create.output, retries=0,
                                   entrypoint=["python", "-c", FAILS_EARLY, *CONFIG], ship_provider=False,
                                   deferrable=True, poll_interval=1)
    # By the literal name when the run has one (held to its owner like any name), else by owner.
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name="{{ params.cluster_name }}", **CONNECTION)
    create >> ready >> [*followed, failing] >> delete.as_teardown(setups=[create, ready])
