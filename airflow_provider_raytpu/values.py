"""Values as users write them in DAGs and templates, read strictly: ``2`` or ``"2"``, ``true`` or ``"True"``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError

__all__ = ["check_prices", "duration_seconds", "parse_bool", "parse_duration", "parse_int", "parse_optional_int",
           "parse_slice_range"]


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
        raise InvalidInputError(
            field, value, f"is more than {maximum}{why_maximum}", f"Write a number such as {example}"
        )
    return number


def parse_optional_int(value: Any, field: str, *, example: int) -> int | None:
    """Like :func:`parse_int`, but ``None`` (or a template that rendered ``"None"`` or ``""``) stays unset."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None")):
        return None
    return parse_int(value, field, example=example)


#: The longest duration taken as seconds: 100 years (``timedelta`` overflows past about 2.7 million).
MAX_SECONDS = 100 * 365 * 24 * 3600


def parse_duration(value: Any, field: str, *, example: str, why_positive: str = "",
                   allow_zero: bool = False) -> timedelta:
    """A duration given as a ``timedelta`` or a number of seconds (a template's ``"600"`` too), more than zero.

    :param example: a value to suggest, e.g. ``"timedelta(minutes=20)"``.
    :param why_positive: what zero or less would mean, for the error.
    :param allow_zero: zero is a duration too (no grace, no wait).
    """
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", value):
        value = float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or abs(value) > MAX_SECONDS:
            raise InvalidInputError(field, value, "is not a finite number of seconds (at most 100 years)",
                                    f"Give e.g. {example}")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise InvalidInputError(field, value, "is not a duration",
                                f"Give a timedelta, e.g. {example}, or a number of seconds")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        shorter = "shorter than zero" if allow_zero else "not longer than zero"
        raise InvalidInputError(field, value, f"is {shorter}{why_positive}", f"Give e.g. {example}")
    return value


def duration_seconds(value: Any, field: str, *, example: str, allow_zero: bool = False) -> float:
    """A task's duration parameter, a ``timedelta`` or a number of seconds, in seconds.

    :raises InvalidInputError: naming the field, the value and an example.
    """
    return parse_duration(value, field, example=example, allow_zero=allow_zero).total_seconds()


def parse_bool(value: Any, field: str) -> bool:
    """Read a flag strictly: ``True``/``False`` or the strings ``"true"``/``"false"`` (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidInputError(field, value, "is not true or false", "Write true or false")


def parse_slice_range(value: Any, field: str = "num_slices") -> tuple[int, int] | None:
    """A range of slice counts ``(min, max)``: a pair, or a template's ``"(1, 2)"``, ``"[1, 2]"`` or ``"1,2"``.
    A single count (``2``, ``"2"``) or ``None`` is no range: ``None``.

    :raises InvalidInputError: for anything else, for a count below 1 and for ``min`` above ``max``.
    """
    fix = "Write a slice count such as 2, or a range (min, max) such as (1, 2)"
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, str):
        text = value.strip()
        if "," not in text:
            return None
        parts: Any = text.strip("()[] ").split(",")
    else:
        parts = value
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        raise InvalidInputError(field, value, "is neither a slice count nor a (min, max) range", fix)
    try:
        low, high = (parse_int(part, field, example=1) for part in parts)
    except InvalidInputError as error:
        raise InvalidInputError(field, value, f"has a bound that {error.problem}", fix) from None
    if low > high:
        raise InvalidInputError(field, value, f"asks for at least {low} slices but at most {high}", fix)
    return low, high


def check_prices(prices: Any, field: str = "chip_hour_prices") -> dict[str, dict[str, float]]:
    """A price per chip-hour by TPU generation and capacity kind: ``{"v6e": {"spot": 1.1, "on-demand": 2.7}}``.

    :raises InvalidInputError: for anything else.
    """
    example = 'e.g. {"v6e": {"on-demand": 2.7, "spot": 1.1}} in your currency per chip-hour'
    if prices is None:
        return {}
    if not isinstance(prices, Mapping) or not all(
        isinstance(kinds, Mapping) and all(
            isinstance(price, (int, float)) and not isinstance(price, bool) and price >= 0 for price in kinds.values())
        for kinds in prices.values()
    ):
        raise InvalidInputError(field, prices, "is not a table of prices by generation and capacity kind",
                                f"Give {example}")
    return {str(generation): {str(kind): float(price) for kind, price in kinds.items()}
            for generation, kinds in prices.items()}


def plural(count: int, noun: str) -> str:
    """``"1 host"``, ``"2 hosts"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
