"""Kubernetes resource quantities (``500m``, ``8Gi``, ``4``): parse and print them as KubeRay's status does."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

_SUFFIXES = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("0.001"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(q: Any) -> tuple[Decimal, bool]:
    """A Kubernetes quantity -> (value, is_binary_suffix)."""
    s = str(q).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            try:
                return Decimal(s[: -len(suffix)]) * _SUFFIXES[suffix], suffix.endswith("i")
            except InvalidOperation:
                break
    try:
        return Decimal(s), False
    except InvalidOperation:
        return Decimal(0), False


def format_quantity(value: Decimal, binary: bool) -> str:
    """Best-effort canonical form (what Quantity.String() prints for the usual cases)."""
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        v = int(value)
        units = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)) if binary \
            else (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))
        for suffix, mult in units:
            if v % mult == 0:
                return f"{v // mult}{suffix}"
        return str(v)
    milli = value * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return str(value)
