"""Status objects as plain JSON: what a task returns is an XCom, and Airflow keeps a tuple as a tagged object."""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def plain(value: Any) -> Any:
    """``value`` with tuples as lists and enums as their values, so ``json.dumps`` and back gives the same thing.

    Airflow serialises a tuple in an XCom as ``{"__classname__": "builtins.tuple", ...}``;
    a list stays a list.

    :param value: a dataclass (converted with :func:`dataclasses.asdict`), or dicts, lists,
        tuples, enums and scalars.
    """
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def plain_fields(value: DataclassInstance) -> dict[str, Any]:
    """A dataclass instance as :func:`plain` gives it: its fields as a dict of plain JSON.

    :param value: a dataclass instance.
    """
    return {str(key): plain(item) for key, item in asdict(value).items()}
