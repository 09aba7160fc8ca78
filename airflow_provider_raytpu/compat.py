"""The Airflow names this provider uses that Airflow does not export publicly, imported in this one place.

An Airflow upgrade that moves one fails here, and in ``tests/unit/test_compat.py``, not somewhere in a task.
"""

from __future__ import annotations

from typing import Any


def redact(value: Any) -> Any:
    """``value`` as Airflow's secrets masker shows it: the values of keys that look secret, and every secret this
    process registered, as ``***`` (Airflow's own task runner and templater call the same function).

    :param value: a string, or a structure of mappings and lists.
    """
    from airflow.sdk._shared.secrets_masker import redact as airflow_redact

    return airflow_redact(value)


def never_expire() -> Any:
    """The ``retention`` that keeps a key in Airflow's task state store for as long as its DAG run exists
    (``NEVER_EXPIRE``, which ``airflow.sdk`` does not export)."""
    from airflow.sdk.execution_time.context import NEVER_EXPIRE

    return NEVER_EXPIRE
