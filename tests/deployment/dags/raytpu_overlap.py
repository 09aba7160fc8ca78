"""Overlapping runs writing one literal output, for the overlap soak: a backfill of three dates runs at once
(``max_active_runs=3``), each run's ``write`` replacing ``OUTPUT`` with the input's rows tagged with its run id,
and each run's ``read`` reading the output through its record while the writes swap, until every run's write
has ended. The cluster ``overlap-ray`` is the test's."""

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, task

from airflow_provider_raytpu.operators.ray_data import RayDataOperator

DAG_ID = "raytpu_overlap"
INPUT = "gs://raytpu-test/overlap/raw.jsonl"
OUTPUT = "gs://raytpu-test/overlap/out"
ROWS = 400
ENDED = ("success", "failed", "upstream_failed", "skipped", "removed")

# Ended (end_date) so that unpausing it, which its task instances need, schedules no run of its own.
with DAG(DAG_ID, schedule="@daily", start_date=datetime(2026, 11, 1), end_date=datetime(2026, 11, 5), catchup=False,
         max_active_runs=3,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=5)}):
    RayDataOperator(task_id="write", cluster_name="overlap-ray", input_uri=INPUT, output_uri=OUTPUT,
                    transform="overlap_rows.rows:tag_run", transform_kwargs={"run": "{{ run_id }}"}, batch_size=100,
                    runtime_env={"py_modules": [str(Path(__file__).resolve().parent / "overlap_rows")]},
                    poll_interval=1)

    @task(retries=0)
    def read(ti=None) -> dict:
        """Read the output through its record (as the provider's readers do) until every run's write ended:
        how many reads saw one run's rows, all of them; how many a mix (none may); how many raced a swap."""
        import time

        import pyarrow.parquet as pq

        from airflow_provider_raytpu.workloads import outputs, storage

        location = storage.resolve(OUTPUT)
        seen = {"one_run_whole": 0, "mixed_or_partial": 0, "raced_a_swap": 0, "nothing_yet": 0, "runs_seen": []}
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            states = ti.get_task_states(dag_id=DAG_ID, task_ids=["write"])
            done = all(by_task.get("write") in ENDED for by_task in states.values())
            committed = outputs.committed_files(location)
            if committed is None or not committed[0]:
                seen["nothing_yet"] += 1
            else:
                try:
                    table = pq.ParquetDataset(committed[0], filesystem=location.filesystem).read(columns=["run"])
                except (OSError, ValueError):  # a file of the version read was removed by a later swap
                    seen["raced_a_swap"] += 1
                else:
                    runs = sorted(set(table.column("run").to_pylist()))
                    whole = len(runs) == 1 and table.num_rows == ROWS
                    seen["one_run_whole" if whole else "mixed_or_partial"] += 1
                    seen["runs_seen"] = sorted({*seen["runs_seen"], *runs})
            if done:
                return seen
            time.sleep(0.3)
        raise TimeoutError(f"the writes did not end within 900 s: {seen}")

    read()
