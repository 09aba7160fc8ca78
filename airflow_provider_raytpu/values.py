"""Values as users write them in DAGs and templates, read strictly: ``2`` or ``"2"``, ``true`` or ``"True"``."""

from __future__ import annotations

import re
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError

__all__ = ["parse_bool", "parse_int", "parse_optional_int"]


def parse_int(value: Any, field: str, *, minimum: int = 1, example: int = 2, maximum: int | None = None,
              why_maximum: str = "") -> int:
    """Read a whole number strictly: ``2`` or ``"2"``, never ``2.5``, ``"two"`` or ``True``."""
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    else:
        number = None
    if number is None:
        raise InvalidInputError(field, value, "is not a whole number", f"Write a number such as {example}")
    if number < minimum:
        raise InvalidInputError(field, value, f"must be at least {minimum}", f"Write a number such as {example}")
    if maximum is not None and number > maximum:
        raise InvalidInputError(field, value, f"is more than {maximum}{why_maximum}", f"Write a number such as {example}")
    return number


def parse_optional_int(value: Any, field: str, *, example: int) -> int | None:
    """Like :func:`parse_int`, but ``None`` (or a template that rendered ``"None"`` or ``""``) stays unset."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
        return None
    return parse_int(value, field, example=example)


def parse_bool(value: Any, field: str) -> bool:
    """Read a flag strictly: ``True``/``False`` or the strings ``"true"``/``"false"`` (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidInputError(field, value, "is not true or false", "Write true or false")
