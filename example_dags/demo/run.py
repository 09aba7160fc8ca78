"""``make demo``: run the ``nightly_finetune`` example DAG end to end on the local backend.

It starts a fake GCS (fake-gcs-server), writes the raw dataset there, points a ``local``
``raytpu`` connection at a private state directory through the environment, runs the DAG
with ``airflow dags test`` on a v4 2x2x2 slice (2 emulated hosts: a real multi-host slice),
prints a summary, and stops everything it started: the served model, every local Ray
cluster and the fake GCS. The per-task wall times also go to ``benchmarks/results/demo.json``,
and the run report the DAG wrote to the fake GCS (JSON and PNG timeline) to ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "example_dags"
BUCKET = "raytpu-demo"
DAG_ID = "nightly_finetune"
CONF = {
    "accelerator": "v4",
    "topology": "2x2x2",
    "slices": "1",
    "capacity": "on-demand",
    "serve_accelerator": "v6e",
    "serve_topology": "2x2",
    "storage": f"gs://{BUCKET}",
    "total_steps": 30,
}
RESULTS = REPO / "benchmarks" / "results" / "demo.json"
REPORT = "report"  # the run report's files, copied out of the fake GCS into the demo's home


def environment(home: Path, gcs_env: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        **gcs_env,
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(EXAMPLES),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow/airflow.db",
        "AIRFLOW_CONN_RAYTPU_DEFAULT": json.dumps(
            {"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(home / "raytpu")}}
        ),
        "RAYTPU_HOME": str(home / "raytpu"),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def airflow(env: dict[str, str], *args: str, log: Path | None = None) -> None:
    command = [str(Path(sys.executable).parent / "airflow"), *args]
    if log is None:
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return
    with log.open("w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-60:])
        raise SystemExit(f"airflow {' '.join(args[:3])} failed ({done.returncode}); log tail:\n{tail}")


def task_outcomes(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each task's state, wall time, XCom and the extras of the asset events it made, from the run's metadata."""
    code = (
        "import json\n"
        "from sqlalchemy import select\n"
        "from airflow.models.asset import AssetEvent\n"
        "from airflow.models.dagrun import DagRun\n"
        "from airflow.utils.session import create_session\n"
        f"run = DagRun.find(dag_id={DAG_ID!r})[-1]\n"
        "with create_session() as session:\n"
        "    events = session.execute(select(AssetEvent.source_task_id, AssetEvent.extra).where(\n"
        "        AssetEvent.source_dag_id == run.dag_id, AssetEvent.source_run_id == run.run_id)).all()\n"
        "out = {ti.task_id: {'state': str(ti.state), 'try_number': ti.try_number,\n"
        "        'seconds': (ti.end_date - ti.start_date).total_seconds() if ti.end_date and ti.start_date else None,\n"
        "        'result': ti.xcom_pull(task_ids=ti.task_id),\n"
        "        'asset_extras': [extra for task, extra in events if task == ti.task_id]}\n"
        "       for ti in run.get_task_instances()}\n"
        "print('OUTCOMES ' + json.dumps(out, default=str))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("OUTCOMES "))
    return json.loads(line[len("OUTCOMES "):])


def stop_local_ray(env: dict[str, str]) -> None:
    """Delete the served model and every cluster the demo made (by their recorded processes only)."""
    code = (
        "from airflow_provider_raytpu.hooks.raytpu import RayTpuHook\n"
        "backend = RayTpuHook().backend\n"
        "backend.services.delete_service('finetuned-regressor', 'default')\n"
        "for cluster in backend.list_clusters(None, ''):\n"
        "    backend.delete_cluster(cluster['metadata']['name'], cluster['metadata']['namespace'])\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def copy_report(gcs: Any, to: Path) -> list[str]:
    """Copy the run's report files (``run_report.json`` and ``.png``) out of the fake GCS; returns their URIs."""
    names = [n for n in gcs.list_objects(BUCKET, "reports/") if n.rsplit("/", 1)[-1].startswith("run_report.")]
    to.mkdir(parents=True, exist_ok=True)
    for name in names:
        (to / name.rsplit("/", 1)[-1]).write_bytes(gcs.read_object(BUCKET, name))
    return [f"gs://{BUCKET}/{name}" for name in names]


def summary(outcomes: dict[str, dict[str, Any]], total: float) -> str:
    create, prep, train = outcomes["create_cluster"], outcomes["preprocess"], outcomes["train"]
    tpu = create["result"]["tpu"]
    answer = (outcomes["wait_serving"].get("result") or {}).get("smoke", {})
    lines = [
        "",
        "nightly_finetune on the local backend",
        f"  slice           {tpu['accelerator']} {tpu['topology']} x {tpu['num_slices']} "
        f"(dashboard {create['result']['dashboard_url']})",
        f"  rows processed  {prep['result']['rows_in']} in, {prep['result']['rows_out']} out "
        f"({prep['result']['rows_per_second']:.0f} rows/s) -> {prep['result']['output_uri']}",
        f"  steps trained   {train['result']['steps']} (resumed from step "
        f"{train['result']['resumed_from_step'] if train['result']['resumed_from_step'] is not None else '- (fresh)'}"
        "), "
        f"loss {train['result']['metrics']['loss']:.4f}, eval loss {train['result']['metrics']['eval_loss']:.4f}",
        f"  checkpoint      {train['result']['checkpoint_uri']}",
        f"  served answer   {json.dumps(answer)}",
        f"  asset event     finetuned_regressor: {json.dumps(outcomes['wait_serving']['asset_extras'])}",
        "  wall time per task:",
    ]
    for task, outcome in sorted(outcomes.items(), key=lambda kv: kv[1]["seconds"] or 0, reverse=True):
        seconds = f"{outcome['seconds']:.1f} s" if outcome["seconds"] is not None else "-"
        lines.append(f"    {task:<20} {outcome['state']:<8} {seconds}")
    lines.append(f"  total           {total:.0f} s")
    report = outcomes["run_report"]["result"]
    if report:
        from airflow_provider_raytpu.status.run_report import report_table

        lines.append("  run report:")
        lines += [f"    {label:<34} {value}" for label, value in report_table(report)]
    return "\n".join(lines)


def run(home: Path) -> tuple[dict[str, dict[str, Any]], float]:
    """Run the DAG once with a fresh fake GCS, its state and its log (``home/dag.log``) in ``home``.

    Returns each task's outcome and the run's wall time; stops what it started and leaves this
    process's environment as it found it.
    """
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(EXAMPLES))
    from example_dags.demo.fake_gcs import FakeGcsServer

    (home / "airflow").mkdir(parents=True, exist_ok=True)
    environ = dict(os.environ)
    with FakeGcsServer() as gcs:
        gcs.create_bucket(BUCKET)
        env = environment(home, gcs.airflow_env())
        os.environ.update(gcs.env())
        try:
            from pipeline.data import write_dataset

            write_dataset(f"gs://{BUCKET}/raw/rows.jsonl", 2000, seed=7)
            print(f"fake GCS at {gcs.url}; raw data at gs://{BUCKET}/raw/rows.jsonl; state in {home}", flush=True)
            airflow(env, "db", "migrate")
            print(f"running `airflow dags test {DAG_ID}` (log: {home / 'dag.log'})", flush=True)
            run_started = time.monotonic()
            airflow(env, "dags", "test", DAG_ID, "--conf", json.dumps(CONF), log=home / "dag.log")
            total = time.monotonic() - run_started
            outcomes = task_outcomes(env)
            for uri in copy_report(gcs, home / REPORT):
                print(f"run report at {uri}", flush=True)
        finally:
            stop_local_ray(env)
            os.environ.clear()
            os.environ.update(environ)
    return outcomes, total


def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="raytpu-demo-"))
    started = time.monotonic()
    outcomes, total = run(home)
    failed = {t: o["state"] for t, o in outcomes.items() if o["state"] != "success"}
    if failed:
        raise SystemExit(f"tasks did not succeed: {failed}; see {home / 'dag.log'}")
    print(summary(outcomes, total))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"tasks": {t: o["seconds"] for t, o in outcomes.items()},
                                   "total_seconds": total, "wall_seconds": time.monotonic() - started}, indent=2))
    for report in sorted((home / REPORT).iterdir()):
        shutil.copy(report, RESULTS.parent / f"demo_{report.name}")
        print(f"  {report.name:<16} copied to {RESULTS.parent / f'demo_{report.name}'}")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
