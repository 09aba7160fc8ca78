"""The run report task: one JSON report and one PNG timeline per DAG run, next to its checkpoints."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, TriggerRule

from airflow_provider_raytpu.connection import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.hooks.run_files import check_report_uri, write_report_files
from airflow_provider_raytpu.status.run_report import (
    TASK_SPAN_XCOM_KEY,
    TRAINING_ATTEMPTS_XCOM_KEY,
    build_report,
    report_table,
)
from airflow_provider_raytpu.status.usage import USAGE_XCOM_KEY
from airflow_provider_raytpu.tasks.base import TeardownWhateverHappenedMixin, check_literal, fail_fast
from airflow_provider_raytpu.tasks.links import RunReportLink, push_link, storage_console_url

if TYPE_CHECKING:
    from airflow.sdk import Context

REPORT_JSON = "run_report.json"
REPORT_PNG = "run_report.png"


def records(value: Any) -> list[dict[str, Any]]:
    """The usage records in a teardown's XCom: its list, or a mapped teardown's lists."""
    if isinstance(value, dict):
        return [value]
    if value is None or isinstance(value, (str, bytes)):
        return []
    return [record for item in value for record in records(item)]


class RunReportOperator(TeardownWhateverHappenedMixin, BaseOperator):
    """Write this DAG run's report: ``run_report.json`` and a PNG timeline, ``run_report.png``.

    Put it last, as a teardown after the cluster's: ``[delete, last_task] >> report.as_teardown()`` runs it
    whatever happened upstream and leaves the DAG run's state to its other tasks (no setups: a Clear of a
    task after the cluster's teardown must not create the cluster again). It reads what the run's
    tasks recorded: each :class:`~airflow_provider_raytpu.operators.raycluster.DeleteRayClusterOperator`'s
    ``tpu_usage`` (chip-hours by capacity kind from ready to gone, slices made again, the cost estimate),
    each :class:`~airflow_provider_raytpu.operators.jax_trainer.JaxTrainerOperator`'s ``training_attempts``
    (the training steps restarts lost), when each provider task ran, each task's state and duration, and
    the rows/s and steps/s of the run's Ray Data and training jobs. The PNG has one row per slice (bars from
    create to ready to gone, coloured by capacity kind, a cross where a slice was made again) and one per task,
    over a table of the figures.
    Two runs' reports of the same job compare capacity kinds: total chip-hours, cost and cost per 1000 steps.

    The files go to ``<report_uri>/<dag_id>/<run_id>/``, replacing an earlier try's. The task's
    "Run report" link opens that folder in the Cloud console (``gs://`` only). Returns the report (the JSON).

    :param report_uri: ``gs://bucket/prefix`` (e.g. next to the checkpoints) or an absolute local directory;
        default: ``reports`` in the local backend's state directory (required on Kubernetes and GKE).
    :param raytpu_conn_id: the ``raytpu`` connection (its ``gcp_conn_id`` writes to ``gs://``); default
        ``raytpu_default``.
    :param draw: also draw the PNG (needs matplotlib: ``pip install 'airflow-provider-raytpu[report]'``;
        without it the report is JSON only, with a warning).
    """

    template_fields: Sequence[str] = ("report_uri", "raytpu_conn_id")
    operator_extra_links = (RunReportLink(),)
    ui_color = "#e8f0fe"

    def __init__(self, *, report_uri: str | None = None, raytpu_conn_id: str | None = None, draw: bool = True,
                 trigger_rule: str = TriggerRule.ALL_DONE, **kwargs: Any) -> None:
        super().__init__(trigger_rule=trigger_rule, **kwargs)
        if report_uri is not None:
            check_literal(report_uri, check_report_uri)
        self.report_uri = report_uri
        self.raytpu_conn_id = raytpu_conn_id
        self.draw = draw

    def directory(self, context: Context, hook: RayTpuHook) -> str:
        """``<report_uri>/<dag_id>/<run_id>``, with a run id's ``:`` and ``+`` made path-safe."""
        base = self.report_uri
        if not base:
            if hook.settings.backend != "local":
                raise FatalError(f"report_uri is not set: on the {hook.settings.backend} backend give "
                                 "gs://bucket/prefix (e.g. next to the checkpoints) where the run report goes")
            from airflow_provider_raytpu.backends.local.state import local_home

            base = str(local_home(hook.settings) / "reports")
        ti = context["ti"]
        return f"{check_report_uri(base)}/{ti.dag_id}/{re.sub(r'[^A-Za-z0-9._=-]+', '_', ti.run_id)}"

    def collect(self, context: Context) -> dict[str, Any]:
        """The report, from the XComs of every other task of this run and the run's task states."""
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        ti = context["ti"]
        spans, results, attempts, usages = {}, {}, {}, []
        for task_id in self.dag.task_ids:
            if task_id == self.task_id:
                continue
            if isinstance(span := ti.xcom_pull(task_ids=task_id, key=TASK_SPAN_XCOM_KEY), dict):
                spans[task_id] = span
            if isinstance(progress := ti.xcom_pull(task_ids=task_id, key=TRAINING_ATTEMPTS_XCOM_KEY), dict):
                attempts[task_id] = progress
            usages += records(ti.xcom_pull(task_ids=task_id, key=USAGE_XCOM_KEY))
            results[task_id] = ti.xcom_pull(task_ids=task_id)
        breadcrumbs = RuntimeTaskInstance.get_task_breadcrumbs(ti.dag_id, ti.run_id)
        tasks = [t for t in breadcrumbs if t["task_id"] != self.task_id]
        return build_report(ti.dag_id, ti.run_id, datetime.now(UTC), tasks, spans, usages, results,
                            attempts)

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            hook = RayTpuHook(self.raytpu_conn_id or DEFAULT_CONN_ID)
            directory = self.directory(context, hook)
            report = self.collect(context)
            files = {REPORT_JSON: json.dumps(report, indent=2, sort_keys=True).encode()}
            if self.draw:
                try:
                    from airflow_provider_raytpu.status.report_png import render_timeline

                    files[REPORT_PNG] = render_timeline(report)
                except ImportError:
                    self.log.warning("No PNG timeline: matplotlib is not installed "
                                     "(pip install 'airflow-provider-raytpu[report]'); the report is JSON only")
            written = write_report_files(directory, files, hook.settings.gcp_conn_id)
        totals = report["totals"]
        self.log.info("Run report of %s, %d cluster(s), %d task(s):", report["run_id"], totals["clusters"],
                      len(report["tasks"]))
        for label, value in report_table(report):
            self.log.info("  %-34s %s", label, value)
        self.log.info("Written to %s", ", ".join(written))
        push_link(context, RunReportLink, storage_console_url(directory))
        return report
