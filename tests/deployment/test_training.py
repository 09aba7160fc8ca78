"""A user clears a finished training task after its teardown deleted the cluster: Airflow re-runs
the task with its setup (``create_cluster``) and teardown, but not the ready sensor, which is no
setup in this DAG. The training task must wait for the re-created cluster instead of failing a try.
The re-created cluster's nodes are held back until ``train`` has started, so it surely finds the
cluster not READY."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deployment.rest import AirflowApi
from tests.support.gcs import GcsStorage

DAG_ID = "raytpu_training"


@dataclass
class Cleared:
    run_id: str
    cleared: list[str]
    run_state: str
    tries: list[dict[str, Any]]


@pytest.fixture(scope="module")
def cluster_gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Open (the file exists) for the first run; the Clear closes it until training has started."""
    gate = tmp_path_factory.mktemp("training") / "cluster-may-start"
    gate.touch()
    return gate


@pytest.fixture(scope="module")
def trained(api: AirflowApi, fake_gcs: GcsStorage, cluster_gate: Path) -> tuple[str, str]:
    """A finished training run: its id and final state."""
    api.unpause(DAG_ID)
    run_id = api.trigger(DAG_ID, {"storage": fake_gcs.uri("deployment-training"), "cluster_gate": str(cluster_gate)})
    return run_id, api.wait_run(DAG_ID, run_id, timeout=420)


@pytest.fixture(scope="module")
def cleared(api: AirflowApi, trained: tuple[str, str], cluster_gate: Path) -> Cleared:
    """Clear ``train`` with the re-created cluster held back (head included) until ``train`` has started."""
    run_id, _ = trained
    cluster_gate.unlink()
    cleared = api.clear(DAG_ID, run_id, "train")
    api.wait("train to start on the cleared run",
             lambda: api.task(DAG_ID, run_id, "train")["state"] not in (None, "scheduled", "queued"), 240)
    cluster_gate.touch()
    state = api.wait_run(DAG_ID, run_id, timeout=420)
    return Cleared(run_id, cleared, state, api.tries(DAG_ID, run_id, "train"))


def test_training_run_trains_and_tears_down(api: AirflowApi, trained: tuple[str, str]) -> None:
    run_id, state = trained
    assert state == "success", api.run_report(DAG_ID, run_id)
    assert api.xcom(DAG_ID, run_id, "train")["steps"] == 4
    assert api.xcom(DAG_ID, run_id, "delete_cluster")["deleted"] is True


def test_clear_reruns_create_and_train_but_not_the_sensor(cleared: Cleared) -> None:
    assert cleared.cleared == ["create_cluster", "delete_cluster", "train"]


def test_cleared_training_waits_for_the_new_cluster_without_a_failed_try(api: AirflowApi, cleared: Cleared) -> None:
    assert cleared.run_state == "success", api.run_report(DAG_ID, cleared.run_id)
    failed_tries = "\n".join(f"--- try {t['try_number']} ({t['state']}) ---\n" +
                             "\n".join(api.log(DAG_ID, cleared.run_id, "train", t["try_number"])[-15:])
                             for t in cleared.tries if t["state"] != "success")
    assert [(t["try_number"], t["state"]) for t in cleared.tries] == [(1, "success"), (2, "success")], failed_tries


@pytest.fixture(scope="module")
def failed_training(api: AirflowApi, fake_gcs: GcsStorage) -> tuple[str, str]:
    """A run of ``raytpu_training_error``, whose train loop raises at step 0: its id and final state."""
    api.unpause("raytpu_training_error")
    run_id = api.trigger("raytpu_training_error", {"storage": fake_gcs.uri("deployment-training-error")})
    return run_id, api.wait_run("raytpu_training_error", run_id, timeout=420)


def test_a_failed_training_reads_as_cleanly_as_a_success(api: AirflowApi, failed_training: tuple[str, str]) -> None:
    """The failed training task's log, read through REST as the UI gets it: no escape codes (raw or escaped in
    the logged trigger event), the task's error first names the job and the loop's own exception and place,
    and the loop's traceback is there once (the driver's, at the end of the job's log)."""
    run_id, state = failed_training
    assert state == "failed", api.run_report("raytpu_training_error", run_id)
    assert [(t["try_number"], t["state"]) for t in api.tries("raytpu_training_error", run_id, "train")] == [
        (1, "failed")]
    records = api.log_records("raytpu_training_error", run_id, "train", 1)
    raw = json.dumps(records)
    assert "\\u001b" not in raw and "\\\\x1b" not in raw  # neither the character nor its escaped spelling
    errors = [detail["exc_value"] for record in records for detail in record.get("error_detail") or []
              if detail.get("exc_type") == "AirflowException"]
    assert len(errors) == 1, raw[-4000:]
    headline, where, *_ = errors[0].splitlines()
    assert re.fullmatch(r"Ray job raytpu-\S+-try1 FAILED: ValueError: could not convert string to float: 'fast'",
                        headline), errors[0]
    assert where == "  at pipeline/train_loop.py, line 101, in train"
    lines = [str(record.get("event", "")) for record in records]
    source = [i for i, line in enumerate(lines) if 'optimizer = make_optimizer(float(config["learning_rate"]))' in line]
    assert len(source) == 1, "\n".join(lines[-60:])
    job_id = headline.split()[2]
    assert any(line.startswith(f"Ray job {job_id} FAILED after ") for line in lines), lines
    assert "run_user_loop" not in raw
    assert api.task("raytpu_training_error", run_id, "delete_cluster")["state"] == "success"
