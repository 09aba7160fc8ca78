"""The run report: totals by capacity kind, throughput from job results, the timeline's rows, the PNG, where it goes."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import pytest

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.hooks.run_files import check_report_uri, write_report_files
from airflow_provider_raytpu.operators.run_report import RunReportOperator, records
from airflow_provider_raytpu.status.report_png import render_timeline
from airflow_provider_raytpu.status.run_report import PROVISIONING, build_report, report_table, timeline_rows

T0 = datetime(2026, 12, 5, 2, 0, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).isoformat()


def usage(name: str, kind: str, chip_hours: float, cost: float | None, made_again: str | None = None) -> dict:
    record = {"cluster_name": name, "namespace": "ml", "accelerator": "v6e", "topology": "4x4", "num_slices": 2,
              "chips": 32, "capacity": kind, "created_at": at(0), "ready_at": at(6), "gone_at": at(70),
              "hours": 64 / 60, "chip_hours": {kind: chip_hours}, "slices_recreated": int(made_again is not None),
              "slices": [{"index": 0, "made_again_at": None}, {"index": 1, "made_again_at": made_again}]}
    if cost is not None:
        record["estimated_cost"] = {kind: cost}
    return record


TASKS = [{"task_id": t, "map_index": -1, "state": s, "operator": "Op", "duration": 1.0}
         for t, s in [("create_cluster", "success"), ("preprocess", "success"), ("train", "success"),
                      ("promote_model", "failed")]]
SPANS = {"train": {"start": at(12), "end": at(68)}, "create_cluster": {"start": at(0), "end": at(0.2)}}
RESULTS = {"preprocess": {"rows_in": 2000, "rows_out": 1990, "rows_per_second": 500.0, "seconds": 4.0},
           "train": {"steps": 3000, "resumed_from_step": 1000, "seconds": 400.0, "checkpoint_uri": "gs://b/c"},
           "create_cluster": {"cluster_name": "x"}, "promote_model": None}


def test_totals_sum_each_capacity_kind_and_cost_per_1000_steps_counts_only_steps_trained_in_this_run() -> None:
    report = build_report("nightly", "scheduled__1", T0, TASKS, SPANS,
                          [usage("a", "spot", 30.0, 33.0, at(31)), usage("b", "spot", 4.0, 4.4),
                           usage("c", "reservation", 10.0, 20.0)], RESULTS)
    totals = report["totals"]
    assert totals == {"clusters": 3, "chip_hours": {"spot": 34.0, "reservation": 10.0}, "chip_hours_total": 44.0,
                      "preemptions": 1, "steps_trained": 2000, "estimated_cost": {"spot": 37.4, "reservation": 20.0},
                      "estimated_cost_total": 57.4, "estimated_cost_per_1000_steps": 28.7}
    assert report["throughput"] == [
        {"task_id": "preprocess", "rows": 2000, "rows_per_second": 500.0},
        {"task_id": "train", "steps": 2000, "resumed_from_step": 1000, "steps_per_second": 5.0}]
    assert [t["start"] for t in report["tasks"]] == [at(0), None, at(12), None]
    assert report_table(report) == [
        ("chip-hours, reservation", "10"), ("chip-hours, spot", "34"), ("estimated cost, reservation", "20"),
        ("estimated cost, spot", "37.4"), ("estimated cost per 1000 steps", "28.7"),
        ("slices made again (preemptions)", "1"), ("preprocess: rows/s", "500 (2000 rows)"),
        ("train: steps/s", "5 (2000 steps, resumed from step 1000)")]


def test_without_prices_there_is_no_cost_and_the_table_says_chip_hours_only() -> None:
    report = build_report("nightly", "r", T0, [], {}, [usage("a", "on-demand", 8.0, None)], {})
    assert "estimated_cost" not in report["totals"] and "estimated_cost_per_1000_steps" not in report["totals"]
    assert report_table(report) == [("chip-hours, on-demand", "8"), ("slices made again (preemptions)", "0")]


def test_the_timeline_has_a_row_per_slice_from_create_to_ready_to_gone_and_a_row_per_task_with_a_span() -> None:
    report = build_report("nightly", "r", T0, TASKS, SPANS, [usage("a", "spot", 30.0, None, at(31))], RESULTS)
    rows = timeline_rows(report)
    assert [row.label for row in rows] == ["a slice 0", "a slice 1", "task create_cluster", "task train"]
    created, ready, gone = T0, T0 + timedelta(minutes=6), T0 + timedelta(minutes=70)
    assert rows[0].bars == [(created, ready, PROVISIONING), (ready, gone, "spot")] and rows[0].marks == []
    assert rows[1].marks == [T0 + timedelta(minutes=31)]
    assert rows[3].bars == [(T0 + timedelta(minutes=12), T0 + timedelta(minutes=68), "success")]
    never = dict(usage("b", "spot", 0.0, None), ready_at=None, chip_hours={"spot": 0.0})
    assert timeline_rows(build_report("d", "r", T0, [], {}, [never], {}))[0].bars == [(created, gone, PROVISIONING)]


def test_the_png_is_drawn_with_a_row_for_each_slice_and_task() -> None:
    from PIL import Image

    report = build_report("nightly", "r", T0, TASKS, SPANS, [usage("a", "spot", 30.0, 33.0, at(31))], RESULTS)
    small = Image.open(io.BytesIO(render_timeline(build_report("d", "r", T0, [], {}, [], {}))))
    image = Image.open(io.BytesIO(render_timeline(report)))
    assert image.format == "PNG" and image.width == small.width and image.height > small.height


def test_a_mapped_teardowns_usage_lists_are_flattened() -> None:
    one, two = usage("a", "spot", 1.0, None), usage("b", "spot", 2.0, None)
    assert records([one]) == [one] and records(iter([[one], [two]])) == [one, two]
    assert records(None) == [] and records("text") == []


@pytest.mark.parametrize("value", ["reports", "gs://", "s3://bucket/reports", "gs:///"])
def test_a_report_place_that_is_neither_gcs_nor_an_absolute_directory_fails_when_the_dag_is_parsed(value: str) -> None:
    with pytest.raises(InvalidInputError, match=r"report_uri=.*is not a place for reports. Give gs://bucket/prefix"):
        RunReportOperator(task_id="report", report_uri=value)
    assert check_report_uri("gs://bucket/runs/") == "gs://bucket/runs"
    RunReportOperator(task_id="templated", report_uri="{{ params.storage }}/reports")


def test_local_reports_are_written_into_their_directory_replacing_an_earlier_try(tmp_path) -> None:
    folder = str(tmp_path / "nightly" / "run-1")
    write_report_files(folder, {"run_report.json": b"{}"}, "unused")
    written = write_report_files(folder, {"run_report.json": b'{"try": 2}'}, "unused")
    assert written == [f"{folder}/run_report.json"]
    assert (tmp_path / "nightly/run-1/run_report.json").read_bytes() == b'{"try": 2}'
