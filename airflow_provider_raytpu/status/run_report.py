"""A DAG run's report: what its clusters used and cost, when its slices and tasks ran, and how fast its jobs went.

Built from what the run's tasks recorded: each teardown's usage records
(:mod:`~airflow_provider_raytpu.status.usage`), each provider task's span (``raytpu_task_span``, pushed
when it succeeds), the run's task states and durations, and the jobs' results (rows/s of a Ray Data job,
steps/s of a training job). Two runs' reports answer which capacity was cheaper for the same job:
their totals give chip-hours and cost by capacity kind, the slices made again (preemptions) and the
cost per 1000 steps trained. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_provider_raytpu.status.conditions import parse_time

#: The XCom key of a provider task's ``{"start", "end"}`` (ISO 8601), pushed when the task succeeds.
TASK_SPAN_XCOM_KEY = "raytpu_task_span"
#: The XCom key of what a training task's restarts cost (``workloads.progress.training_progress``).
TRAINING_ATTEMPTS_XCOM_KEY = "training_attempts"
PROVISIONING = "provisioning"


def throughput_of(task_id: str, result: Any, attempts: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A job task's throughput from its result: rows/s of a Ray Data job, steps/s of a training job.

    A training job's ``steps`` are those this run advanced, from the step its first attempt started at
    (``attempts``: its ``training_attempts``) or else the step its job resumed from; the steps restarts
    lost are added from ``attempts``.
    """
    if not isinstance(result, Mapping):
        return None
    if result.get("rows_per_second") is not None:
        return {"task_id": task_id, "rows": result.get("rows_in"), "rows_per_second": result["rows_per_second"]}
    steps, seconds = result.get("steps"), result.get("seconds")
    if isinstance(steps, int) and isinstance(seconds, (int, float)) and "checkpoint_uri" in result:
        started = attempts["started_at_step"] if attempts else (result.get("resumed_from_step") or 0)
        trained = steps - started
        entry = {"task_id": task_id, "steps": trained, "resumed_from_step": started or None,
                 "steps_per_second": round(trained / seconds, 3) if seconds > 0 else None}
        if attempts:
            entry.update(restarts=attempts["restarts"], steps_lost=attempts["steps_lost"])
        return entry
    return None


def _sum_by_kind(records: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for record in records:
        for kind, value in record.items():
            total[kind] = round(total.get(kind, 0.0) + value, 6)
    return total


def build_report(dag_id: str, run_id: str, written_at: datetime, tasks: Iterable[Mapping[str, Any]],
                 spans: Mapping[str, Mapping[str, Any]], usages: Iterable[Mapping[str, Any]],
                 results: Mapping[str, Any], attempts: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The report of one DAG run (plain JSON).

    :param dag_id: the DAG.
    :param run_id: the DAG run.
    :param written_at: when the report is written.
    :param tasks: the run's finished tasks, ``{"task_id", "map_index", "state", "operator", "duration"}``.
    :param spans: each task's recorded span by task id.
    :param usages: the usage records of the run's teardowns.
    :param results: each task's returned result by task id.
    :param attempts: each training task's ``training_attempts`` by task id.
    """
    clusters = [dict(usage) for usage in usages]
    attempts = attempts or {}
    throughput = [t for task_id, result in sorted(results.items())
                  if (t := throughput_of(task_id, result, attempts.get(task_id)))]
    cost = _sum_by_kind(u["estimated_cost"] for u in clusters if u.get("estimated_cost"))
    steps = sum(t["steps"] for t in throughput if "steps" in t)
    totals: dict[str, Any] = {
        "clusters": len(clusters),
        "chip_hours": _sum_by_kind(u["chip_hours"] for u in clusters),
        "preemptions": sum(u.get("slices_recreated", 0) for u in clusters),
        "steps_trained": steps,
    }
    totals["chip_hours_total"] = round(sum(totals["chip_hours"].values()), 6)
    if counted := [t for t in throughput if "steps_lost" in t]:
        totals["restarts"] = sum(t["restarts"] for t in counted)
        totals["steps_lost"] = sum(t["steps_lost"] for t in counted)
    if cost:
        totals["estimated_cost"] = cost
        totals["estimated_cost_total"] = round(sum(cost.values()), 4)
        if steps:
            totals["estimated_cost_per_1000_steps"] = round(1000 * totals["estimated_cost_total"] / steps, 4)
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "written_at": written_at.isoformat(),
        "totals": totals,
        "clusters": clusters,
        "tasks": [{"task_id": t["task_id"], "map_index": t.get("map_index", -1), "state": t.get("state"),
                   "operator": t.get("operator"), "seconds": t.get("duration"),
                   "start": (spans.get(t["task_id"]) or {}).get("start"),
                   "end": (spans.get(t["task_id"]) or {}).get("end")} for t in tasks],
        "throughput": throughput,
    }


def report_table(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report's figures as (label, value) rows, for the log and under the timeline."""
    totals = report["totals"]
    rows = [(f"chip-hours, {kind}", f"{hours:.4g}") for kind, hours in sorted(totals["chip_hours"].items())]
    costs = sorted(totals.get("estimated_cost", {}).items())
    rows += [(f"estimated cost, {kind}", f"{cost:.4g}") for kind, cost in costs]
    if "estimated_cost_per_1000_steps" in totals:
        rows.append(("estimated cost per 1000 steps", f"{totals['estimated_cost_per_1000_steps']:.4g}"))
    rows.append(("slices made again (preemptions)", str(totals["preemptions"])))
    if "steps_lost" in totals:
        restarts = f"{totals['restarts']} restart{'' if totals['restarts'] == 1 else 's'}"
        rows.append(("training steps lost to restarts", f"{totals['steps_lost']} ({restarts})"))
    for t in report["throughput"]:
        if "rows_per_second" in t:
            rows.append((f"{t['task_id']}: rows/s", f"{t['rows_per_second']:.4g} ({t['rows']} rows)"))
        elif t.get("steps_per_second") is not None:
            resumed = f", resumed from step {t['resumed_from_step']}" if t.get("resumed_from_step") else ""
            rows.append((f"{t['task_id']}: steps/s", f"{t['steps_per_second']:.4g} ({t['steps']} steps{resumed})"))
    return rows


@dataclass
class TimelineRow:
    """One row of the timeline: a slice of a cluster, or a task.

    :param label: what the row is.
    :param bars: ``(start, end, what)``: ``what`` is a capacity kind, ``provisioning`` or a task state.
    :param marks: when the slice was made again (a preemption).
    """

    label: str
    bars: list[tuple[datetime, datetime, str]] = field(default_factory=list)
    marks: list[datetime] = field(default_factory=list)


def timeline_rows(report: Mapping[str, Any]) -> list[TimelineRow]:
    """The rows of the report's timeline: per cluster one per slice (created -> ready -> gone, coloured by
    capacity kind, made-again marked), then one per task with a recorded span."""
    rows = []
    for usage in report["clusters"]:
        created, gone = usage.get("created_at"), parse_time(usage["gone_at"])
        ready = parse_time(usage["ready_at"]) if usage.get("ready_at") else None
        (kind,) = usage["chip_hours"]  # a cluster has one capacity kind
        for entry in usage.get("slices") or [{"index": i, "made_again_at": None} for i in range(usage["num_slices"])]:
            row = TimelineRow(f"{usage['cluster_name']} slice {entry['index']}")
            if created:
                row.bars.append((parse_time(created), ready or gone, PROVISIONING))
            if ready:
                row.bars.append((ready, gone, kind))
            if entry.get("made_again_at"):
                row.marks.append(parse_time(entry["made_again_at"]))
            rows.append(row)
    for task in sorted(report["tasks"], key=lambda t: t.get("start") or ""):
        if task.get("start") and task.get("end"):
            rows.append(TimelineRow(f"task {task['task_id']}",
                                    [(parse_time(task["start"]), parse_time(task["end"]), str(task["state"]))]))
    return rows
