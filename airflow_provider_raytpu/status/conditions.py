"""Kubernetes status conditions, read alike for pods, RayClusters and RayServices, and the times they carry."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeGuard


def conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """An object's ``status.conditions`` by type.

    :param status: the object's ``status``.
    """
    return {c.get("type", ""): c for c in status.get("conditions") or []}


def is_true(condition: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    """Whether a condition is present and ``True``.

    :param condition: the condition, ``None`` when it is not set.
    """
    if not condition:
        return False
    return condition.get("status") == "True"


def parse_time(text: str) -> datetime:
    """An RFC 3339 time as Kubernetes writes it (``2026-12-04T21:11:12Z``), timezone-aware.

    :raises ValueError: not such a time.
    """
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
