"""A wait the API server asks for is obeyed up to a cap: a 429's Retry-After of an hour must not hold a teardown."""

from __future__ import annotations

import tenacity
from kubernetes.client.rest import ApiException

from airflow_provider_raytpu.backends.kuberay.clients import RETRY_AFTER_CAP, capped_retries
from airflow_provider_raytpu.backends.kuberay.objects import CappedWait


def wait_after(status: int, retry_after: str | None) -> float:
    error = ApiException(status=status, reason="Too Many Requests")
    error.headers = {"Retry-After": retry_after} if retry_after else {}
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.set_exception((ApiException, error, None))
    return CappedWait()(state)


def test_a_retry_after_is_obeyed_up_to_the_cap() -> None:
    assert wait_after(429, "2") == 2.0
    assert wait_after(429, "3600") == RETRY_AFTER_CAP == 30
    assert 0 < wait_after(503, None) <= RETRY_AFTER_CAP  # no header: exponential, capped too


def test_urllib3_under_the_sync_client_obeys_retry_after_up_to_the_cap() -> None:
    retries = capped_retries()
    assert (retries.total, retries.retry_after_max, retries.parse_retry_after("3600")) == (3, 30, 30)
