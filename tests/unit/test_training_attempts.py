"""What a training run's restarts cost: steps lost from its attempts' records, in the task log and the run report."""

from __future__ import annotations

from datetime import UTC, datetime

from airflow_provider_raytpu.operators.jax_trainer import describe_attempts
from airflow_provider_raytpu.status.run_report import build_report, report_table
from airflow_provider_raytpu.workloads.progress import training_progress

T0 = datetime(2026, 12, 5, 2, 0, tzinfo=UTC)


def attempt(started_at: float, first_step: int, reached: int) -> dict:
    return {"started_at": started_at, "first_step": first_step, "reached": reached}


def test_each_restart_loses_the_steps_reached_beyond_the_checkpoint_the_next_attempt_resumed_from() -> None:
    # Out of order, as listed from storage: a preempted slice at 17 (checkpoint 10), an Airflow retry after 27
    # (checkpoint 25), then the end.
    progress = training_progress([attempt(300.0, 25, 30), attempt(100.0, 0, 17), attempt(200.0, 10, 27)])
    assert progress == {"attempts": 3, "restarts": 2, "steps_lost": 9, "started_at_step": 0,
                        "lost": [{"reached": 17, "resumed_from": 10, "steps_lost": 7},
                                 {"reached": 27, "resumed_from": 25, "steps_lost": 2}]}
    assert describe_attempts(progress) == (
        "2 restarts lost 9 steps (reached 17, resumed from 10; reached 27, resumed from 25)")


def test_an_attempt_whose_record_is_older_than_the_checkpoint_it_wrote_reached_at_least_that_checkpoint() -> None:
    progress = training_progress([attempt(1.0, 0, 8), attempt(2.0, 10, 30)])
    assert progress["lost"] == [{"reached": 10, "resumed_from": 10, "steps_lost": 0}]
    # An attempt that resumed from an older checkpoint than its own start (storage lost the newer) lost it all.
    assert training_progress([attempt(1.0, 20, 24), attempt(2.0, 15, 30)])["lost"] == [
        {"reached": 24, "resumed_from": 15, "steps_lost": 9}]


def test_one_attempt_is_no_restart_and_no_record_is_nothing() -> None:
    progress = training_progress([attempt(1.0, 40, 60)])
    assert progress == {"attempts": 1, "restarts": 0, "steps_lost": 0, "started_at_step": 40, "lost": []}
    assert describe_attempts(progress) == "trained in one attempt, from step 40"
    assert training_progress([]) is None


def test_the_report_counts_steps_from_where_the_first_attempt_started_and_the_steps_restarts_lost() -> None:
    """The job resumed at 10 after an in-job restart, but this run trained from 0: 30 steps of progress."""
    train = {"steps": 30, "resumed_from_step": 10, "seconds": 60.0, "checkpoint_uri": "gs://b/c/30"}
    progress = training_progress([attempt(1.0, 0, 17), attempt(2.0, 10, 30)])
    usage = {"cluster_name": "a", "chip_hours": {"spot": 1.0}, "estimated_cost": {"spot": 3.0}, "slices_recreated": 1}
    report = build_report("nightly", "r", T0, [], {}, [usage], {"train": train}, {"train": progress})
    assert report["throughput"] == [{"task_id": "train", "steps": 30, "resumed_from_step": None,
                                     "steps_per_second": 0.5, "restarts": 1, "steps_lost": 7}]
    totals = report["totals"]
    assert (totals["steps_trained"], totals["restarts"], totals["steps_lost"]) == (30, 1, 7)
    assert totals["estimated_cost_per_1000_steps"] == 100.0
    assert ("training steps lost to restarts", "7 (1 restart)") in report_table(report)
    without = build_report("nightly", "r", T0, [], {}, [usage], {"train": train})
    assert without["totals"]["steps_trained"] == 20 and "steps_lost" not in without["totals"]
    assert "training steps lost to restarts" not in dict(report_table(without))
