"""The demo (``make demo``: the ``nightly_finetune`` example DAG on the local backend, in its own
``airflow dags test`` process) reads cleanly: its task logs, as a user reads them, have no colour
codes, no Ray INFO line where a deployment shows errors, each training step once, and no task
silent for more than 10 s while it waits. Its run report is in the fake GCS, next to the checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from airflow_provider_raytpu.tasks.lineage import checkpoint_dataset
from example_dags.demo.run import DAG_ID, REPORT, run
from tests.support.lineage import completed, datasets
from tests.support.task_logs import LOADED_SILENCE_LIMIT_SECONDS, problems, task_instances_in, task_logs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_the_demo_succeeds_and_its_task_logs_read_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The OpenLineage provider's listener writes each task's events to a file, as it would send them to Marquez.
    lineage = tmp_path / "lineage.jsonl"
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", json.dumps(
        {"type": "file", "log_file_path": str(lineage), "append": True}))
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__NAMESPACE", "raytpu-demo")
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD", "True")
    outcomes, _ = run(tmp_path)
    assert {task: o["state"] for task, o in outcomes.items()} == dict.fromkeys(
        ["create_cluster", "wait_cluster_ready", "preprocess", "train", "delete_cluster", "promote_model",
         "wait_serving", "run_report"], "success")
    # The subprocess wrote stdout and stderr to one file: every line is checked as if it were stderr too.
    text = (tmp_path / "dag.log").read_text()
    tasks = task_instances_in(text, DAG_ID)
    assert sorted(tasks.values()) == sorted(outcomes)
    assert problems(text, text, tasks, limit=LOADED_SILENCE_LIMIT_SECONDS) == {}
    by_task = {log.task_id: [line.message for line in log.provider_lines()] for log in task_logs(text, tasks)}
    assert by_task["train"][-1] == "Restarts: trained in one attempt, from step 0"
    assert by_task["train"][-2].startswith("Step time: median ")
    assert " SUCCEEDED after " in by_task["train"][-3] and " SUCCEEDED after " in by_task["preprocess"][-1]
    assert by_task["delete_cluster"][-2].startswith("RayCluster default/nightly-finetune-")
    assert " and its pods are gone after " in by_task["delete_cluster"][-2]
    assert re.fullmatch(r"RayCluster default/nightly-finetune-\S+ used [0-9.e-]+ chip-hours of on-demand \(8 chips "
                        r"for [0-9.]+ (s|min) from ready to gone\)", by_task["delete_cluster"][-1])

    # The assets other DAGs are scheduled on (after_promotion.py) carry what they need.
    checkpoint = outcomes["train"]["result"]["checkpoint_uri"]
    assert outcomes["wait_serving"]["asset_extras"] == [
        {"service": "default/finetuned-regressor", "served_version": checkpoint}]
    (trained,) = outcomes["train"]["asset_extras"]
    assert (trained["checkpoint_uri"], trained["checkpoint_step"], trained["training_attempts"]["restarts"]) == (
        checkpoint, 30, 0)
    assert outcomes["preprocess"]["asset_extras"] == []  # its output_uri is templated: no outlet declared

    # Lineage: raw rows -> features (with the rows written) -> the checkpoints (versioned by step) -> the service.
    events = completed(lineage, DAG_ID)
    features = outcomes["preprocess"]["result"]["output_uri"].removeprefix("gs://raytpu-demo/")
    checkpoints, checkpoint_version = checkpoint_dataset(checkpoint)
    checkpoints = checkpoints.removeprefix("gs://raytpu-demo/")
    assert datasets(events["preprocess"], "inputs") == [("gs://raytpu-demo", "raw/rows.jsonl")]
    assert datasets(events["preprocess"], "outputs") == [("gs://raytpu-demo", features)]
    assert (events["preprocess"]["outputs"][0]["facets"]["version"]["datasetVersion"]
            == outcomes["preprocess"]["result"]["output_version"])
    written = events["preprocess"]["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"]
    assert written == outcomes["preprocess"]["result"]["rows_out"]
    assert datasets(events["train"], "inputs") == [("gs://raytpu-demo", features)]
    # START and COMPLETE name the same datasets; the checkpoint is a version of the declared checkpoint_uri.
    started = completed(lineage, DAG_ID, "START")
    for task in ("preprocess", "train"):
        assert [datasets(started[task], side) for side in ("inputs", "outputs")] == [
            datasets(events[task], side) for side in ("inputs", "outputs")], task
    assert datasets(events["train"], "outputs") == [("gs://raytpu-demo", checkpoints)]
    assert checkpoint_version.endswith("/orbax/30")
    assert events["train"]["outputs"][0]["facets"]["version"]["datasetVersion"] == checkpoint_version
    assert datasets(events["promote_model"], "inputs") == [("gs://raytpu-demo", checkpoints)]
    assert events["promote_model"]["inputs"][0]["facets"]["version"]["datasetVersion"] == checkpoint_version
    assert datasets(events["promote_model"], "outputs") == [("rayservice://default", "finetuned-regressor")]
    assert events["promote_model"]["outputs"][0]["facets"]["version"]["datasetVersion"] == checkpoint
    report = outcomes["run_report"]["result"]
    assert json.loads((tmp_path / REPORT / "run_report.json").read_text()) == report
    assert (tmp_path / REPORT / "run_report.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    totals = report["totals"]
    assert (totals["clusters"], totals["preemptions"], totals["steps_trained"]) == (1, 0, 30)
    assert (totals["restarts"], totals["steps_lost"]) == (0, 0)
    assert set(totals["chip_hours"]) == {"on-demand"} and totals["chip_hours_total"] > 0
    assert [t["task_id"] for t in report["throughput"]] == ["preprocess", "train"]
    assert {t["task_id"] for t in report["tasks"]} == set(outcomes) - {"run_report"}
    assert by_task["run_report"][-1].startswith(f"Written to gs://raytpu-demo/reports/{DAG_ID}/")
