"""Two Ray jobs on one small slice, each ticking until the test drops its release file.

``count_job`` is followed across a triggerer restart; ``hold_job`` is marked failed while it
runs, then cleared. Both setups (create and the ready sensor) re-run on a Clear. With
``host_gate`` the cluster's TPU host waits for that file, so the ready sensor surely defers.
Each job prints, first and last, the secret its environment gets from the Variable
``job_credential`` (a name Airflow does not mask by itself; the job's ``RAYTPU_API_TOKEN`` is).
"""

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator, DeleteRayClusterOperator
from airflow_provider_raytpu.sensors.raycluster import RayClusterReadySensor

CLUSTER = "{{ ti.xcom_pull('create_cluster')['cluster_name'] }}"
# Prints a numbered tick every half second until the file named by argv[1] exists.
TICKER = (
    "import os, sys, time\n"
    "print('token ' + os.environ.get('RAYTPU_API_TOKEN', ''), flush=True)\n"
    "ticks = 0\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    ticks += 1\n"
    "    print(f'tick {ticks:04d}', flush=True)\n"
    "    time.sleep(0.5)\n"
    "print(f'released after {ticks} ticks', flush=True)\n"
    "print('token ' + os.environ.get('RAYTPU_API_TOKEN', ''), flush=True)\n"
)

with DAG(
    "raytpu_jobs",
    schedule=None,
    start_date=datetime(2026, 12, 1),
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5)},
    params={
        "accelerator": Param("v6e", type="string"),
        "topology": Param("2x2", type="string"),
        "release_dir": Param("/tmp", type="string", description="where the test drops the release files"),
        "host_gate": Param("", type="string", description="the TPU host starts once this file exists"),
    },
):
    create = CreateRayClusterOperator(
        task_id="create_cluster",
        accelerator="{{ params.accelerator }}",
        topology="{{ params.topology }}",
        cluster_options={"env": {"RAYTPU_TEST_HOST_GATE": "{{ params.host_gate }}"}},
    )
    ready = RayClusterReadySensor(
        task_id="wait_ready", cluster_name=CLUSTER, deferrable=True, timeout=600, poke_interval=1
    )
    jobs = [
        SubmitRayJobOperator(
            task_id=task_id,
            cluster_name=CLUSTER,
            entrypoint=["python", "-c", TICKER, "{{ params.release_dir }}/" + task_id],
            runtime_env={"env_vars": {"RAYTPU_API_TOKEN": "{{ var.value.job_credential }}"}},
            ship_provider=False,
            deferrable=True,
            poll_interval=1,
        )
        for task_id in ("count_job", "hold_job")
    ]
    delete = DeleteRayClusterOperator(task_id="delete_cluster", cluster_name=CLUSTER)
    create >> ready >> jobs >> delete.as_teardown(setups=[create, ready])
