"""Connection fields that were renamed: the old name still works for one minor release, with Airflow's
provider deprecation warning naming the new one (CHANGELOG.md lists them).

``ray_token_auth`` became ``ray_auth``: Airflow hides the value of any extra whose name contains
``token`` (``[core] sensitive_var_conn_names`` and its built-in list), so the REST API and the UI showed
it as ``***`` and a connection saved from the form could never pass its Test.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.values import parse_bool

#: A deprecated connection flag (a true-or-false extra) -> its replacement.
RENAMED_FLAGS = {"ray_token_auth": "ray_auth"}


def _set(value: Any) -> bool:
    return value not in (None, "")


def current_extras(conn_id: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` with each deprecated field under its new name, warning once per field it renames.

    :param conn_id: the connection id, for the warning and errors.
    :param extra: the connection's extra JSON as a dict.
    :raises InvalidInputError: both names are set, to different values.
    """
    extras = dict(extra)
    for old, new in RENAMED_FLAGS.items():
        if old not in extras:
            continue
        value = extras.pop(old)
        warnings.warn(f"The raytpu connection {conn_id!r} sets extra.{old}, which is deprecated: rename it to "
                      f"extra.{new}", AirflowProviderDeprecationWarning, stacklevel=3)
        if not _set(value):
            continue
        if _set(extras.get(new)) and parse_bool(extras[new], f"connection {conn_id!r} extra.{new}") != parse_bool(
                value, f"connection {conn_id!r} extra.{old}"):
            raise InvalidInputError(f"connection {conn_id!r} extra.{old}", value,
                                    f"contradicts extra.{new}={extras[new]!r}, which replaces it",
                                    f"Remove extra.{old} and keep extra.{new}")
        extras[new] = extras.get(new) if _set(extras.get(new)) else value
    return extras
