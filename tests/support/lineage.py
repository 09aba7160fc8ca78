"""The OpenLineage events a run emitted, as the OpenLineage provider's file transport wrote them (one per line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def completed(path: Path, dag_id: str, event_type: str = "COMPLETE") -> dict[str, dict[str, Any]]:
    """The COMPLETE (or ``event_type``) event of each task of ``dag_id``, by task id (the last, when a task had
    more than one)."""
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {event["job"]["name"].removeprefix(f"{dag_id}."): event for event in events
            if event["eventType"] == event_type and event["job"]["name"].startswith(f"{dag_id}.")}


def datasets(event: dict[str, Any], side: str) -> list[tuple[str, str]]:
    """The (namespace, name) of each of an event's ``inputs`` or ``outputs``."""
    return [(dataset["namespace"], dataset["name"]) for dataset in event[side]]
