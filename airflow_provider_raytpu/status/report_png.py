"""The run report's PNG: the timeline of its slices and tasks above a table of its figures (matplotlib).

matplotlib comes with the provider's ``report`` extra; it is imported only here, when a report is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from airflow_provider_raytpu.status.run_report import PROVISIONING, report_table, timeline_rows

COLOURS = {
    PROVISIONING: "#cfd8dc",
    "on-demand": "#4285f4",
    "spot": "#f4b400",
    "reservation": "#0f9d58",
    "flex-start": "#ab47bc",
    "success": "#90a4ae",
    "failed": "#e53935",
    "upstream_failed": "#ffab91",
    "skipped": "#eceff1",
}
OTHER = "#b0bec5"
PREEMPTED = "#c62828"


def render_timeline(report: Mapping[str, Any]) -> bytes:
    """The report drawn as a PNG: one row per slice (bars from create to ready to gone, coloured by capacity
    kind, preemptions marked) and per task, and the table of figures under it.

    :param report: :func:`~airflow_provider_raytpu.status.run_report.build_report`.
    :raises ImportError: matplotlib is not installed (``pip install 'airflow-provider-raytpu[report]'``).
    """
    from matplotlib.figure import Figure  # drawn without pyplot: no backend is chosen for the whole process
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = timeline_rows(report)
    table = report_table(report)
    times = [t for row in rows for bar in row.bars for t in bar[:2]] + [t for row in rows for t in row.marks]
    origin = min(times) if times else None

    def minutes(when: datetime) -> float:
        assert origin is not None  # asked only of the times, so there is one
        return (when - origin).total_seconds() / 60

    figure = Figure(figsize=(11, 1.6 + 0.34 * max(len(rows), 1) + 0.24 * len(table)), dpi=110, layout="constrained")
    axes, below = figure.subplots(2, 1, height_ratios=(0.34 * max(len(rows), 1) + 0.5, 0.24 * len(table) + 0.1))
    seen: dict[str, str] = {}
    for y, row in enumerate(rows):
        for start, end, what in row.bars:
            colour = COLOURS.get(what, OTHER)
            seen.setdefault(what, colour)
            axes.barh(y, max(minutes(end) - minutes(start), 0.02), left=minutes(start), height=0.6,
                      color=colour, edgecolor="#37474f", linewidth=0.4)
        for mark in row.marks:
            axes.plot(minutes(mark), y, marker="X", color=PREEMPTED, markersize=10, linestyle="none")
    axes.set_yticks(range(len(rows)), [row.label for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"minutes since {origin:%Y-%m-%d %H:%M:%S} UTC" if origin else "no recorded times", fontsize=8)
    axes.tick_params(axis="x", labelsize=8)
    axes.grid(axis="x", color="#eceff1")
    axes.set_axisbelow(True)
    figure.suptitle(f"{report['dag_id']}   {report['run_id']}", fontsize=10, x=0.01, ha="left")
    handles: list[Any] = [Patch(color=colour, label=label) for label, colour in seen.items()]
    if any(row.marks for row in rows):
        handles.append(Line2D([], [], marker="X", color=PREEMPTED, linestyle="none", label="made again (preempted)"))
    figure.legend(handles=handles, fontsize=8, loc="outside upper right", ncols=len(handles), frameon=False)
    below.axis("off")
    if table:
        cells = below.table(cellText=[list(row) for row in table], loc="upper left", cellLoc="left",
                            colWidths=(0.35, 0.45), edges="horizontal")
        cells.auto_set_font_size(False)
        cells.set_fontsize(8)
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()
