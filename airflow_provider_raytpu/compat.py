"""The Airflow names this provider uses that Airflow does not export publicly, imported in this one place.

An Airflow upgrade that moves one fails here, and in ``tests/unit/test_compat.py``, not somewhere in a task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s_async


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


def resolvable_type() -> type[Any]:
    """The base class of what Airflow resolves only at run time (an ``XComArg``, a ``Param``'s reference):
    ``ResolveMixin``, which ``airflow.sdk`` does not export."""
    from airflow.sdk.definitions._internal.mixins import ResolveMixin

    return ResolveMixin


def timeout_async_api_client(configuration: Any) -> k8s_async.ApiClient:
    """The cncf-kubernetes provider's asyncio API client that applies the configured request timeout
    (``_TimeoutAsyncK8sApiClient``, what its own async hook builds; private in ``kube_client``)."""
    from airflow.providers.cncf.kubernetes.kube_client import _TimeoutAsyncK8sApiClient

    return _TimeoutAsyncK8sApiClient(configuration=configuration)
