"""A training run's record of its config: a resume under another config is refused, started fresh or allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_raytpu.workloads.run_record import RECORD_NAME, TrainingConfigChangedError, settle_run
from airflow_provider_raytpu.workloads.storage import resolve

CONFIG = {"train_loop": "pipeline.train_loop:train", "config": {"seed": 11, "api_key": "s3cr3t-value"},
          "datasets": {"eval": "gs://b/prep"}, "batch_size": 32, "ragged_policy": "pad"}


def changed(**config: object) -> dict:
    return {**CONFIG, "config": {**CONFIG["config"], **config}}


def test_the_same_config_resumes_the_same_run(tmp_path: Path) -> None:
    root = resolve(str(tmp_path))
    assert settle_run(root, "run-1", CONFIG) == "run-1"
    assert settle_run(root, "run-1", json.loads(json.dumps(CONFIG))) == "run-1", "key order does not matter"
    record = (tmp_path / "run-1" / RECORD_NAME).read_text()
    assert "s3cr3t-value" not in record and "11" not in json.loads(record)["keys"].values(), "digests only"


def test_a_changed_config_is_refused_by_its_keys_never_its_values(tmp_path: Path) -> None:
    root = resolve(str(tmp_path))
    settle_run(root, "run-1", CONFIG)
    with pytest.raises(TrainingConfigChangedError) as refused:
        settle_run(root, "run-1", {**changed(seed=12, api_key="n3w-s3cr3t"), "batch_size": 64})
    message = str(refused.value)
    assert message.startswith(f"training run run-1 ({tmp_path}/run-1) was started with another training config: "
                              "batch_size, config.api_key, config.seed changed.")
    assert "on_config_change='start_fresh'" in message and "on_config_change='resume'" in message
    assert "s3cr3t" not in message


def test_start_fresh_trains_a_new_run_and_keeps_the_old_one(tmp_path: Path) -> None:
    root = resolve(str(tmp_path))
    settle_run(root, "run-1", CONFIG)
    fresh = settle_run(root, "run-1", changed(seed=12), "start_fresh")
    assert fresh.startswith("run-1-c") and fresh != "run-1"
    assert settle_run(root, "run-1", changed(seed=12), "start_fresh") == fresh, "its retry resumes the new run"
    assert settle_run(root, fresh, changed(seed=12)) == fresh
    assert settle_run(root, "run-1", CONFIG) == "run-1", "the old run, and its record, are untouched"


def test_resume_anyway_takes_the_new_config_and_notes_the_change(tmp_path: Path) -> None:
    root = resolve(str(tmp_path))
    settle_run(root, "run-1", CONFIG)
    assert settle_run(root, "run-1", changed(seed=12), "resume") == "run-1"
    record = json.loads((tmp_path / "run-1" / RECORD_NAME).read_text())
    assert [entry["resumed_with_changed_keys"] for entry in record["history"]] == [["config.seed"]]
    assert settle_run(root, "run-1", changed(seed=12)) == "run-1", "from then on the new config is the run's"
