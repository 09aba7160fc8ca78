"""The private Airflow names in airflow_provider_raytpu/compat.py and the private Ray names in
airflow_provider_raytpu/workloads/ray_compat.py still exist and still behave as the provider needs: an upgrade
that moves or changes one fails here."""

from __future__ import annotations

import pytest

from airflow_provider_raytpu.compat import redact
from airflow_provider_raytpu.tasks.base import mask_secret_values


def test_redact_hides_the_values_of_keys_that_look_secret() -> None:
    assert redact({"api_key": "k-8c1f0e2a", "steps": 3, "nested": {"password": ["p-44aa21", "p-55bb32"]}}) == {
        "api_key": "***", "steps": 3, "nested": {"password": ["***", "***"]}}


def test_a_registered_value_is_what_a_trigger_carries_and_is_hidden_in_any_text() -> None:
    config = {"lr": 0.1, "hf_token": "hf-3b9d7c1e55", "data": {"db_password": "pw-71c2e9d0"}, "name": "run-a"}
    assert mask_secret_values(config) == ["hf-3b9d7c1e55", "pw-71c2e9d0"]
    assert redact("loaded hf-3b9d7c1e55 and pw-71c2e9d0 for run-a") == "loaded *** and *** for run-a"
    assert mask_secret_values(None) == mask_secret_values({}) == []


def test_what_airflow_resolves_at_run_time_is_a_resolvable_type() -> None:
    from airflow.sdk import DAG, BaseOperator

    from airflow_provider_raytpu.compat import resolvable_type
    from airflow_provider_raytpu.tasks.base import is_templated

    with DAG("compat_resolvable", schedule=None):
        upstream = BaseOperator(task_id="upstream")
    assert isinstance(upstream.output, resolvable_type()) and is_templated({"uri": [upstream.output]})
    assert not isinstance("gs://bucket/rows", resolvable_type())


async def test_the_kubernetes_client_sets_a_request_timeout_where_the_generated_client_passes_none() -> None:
    """The generated kubernetes_asyncio methods pass ``_request_timeout=None``; without a timeout a half-open
    connection hangs a trigger forever."""
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.compat import timeout_async_api_client

    sent: list[object] = []

    class Recording(k8s_async.ApiClient):
        async def call_api(self, *args: object, **kwargs: object) -> object:
            sent.append(kwargs.get("_request_timeout"))
            return None

    api = timeout_async_api_client(k8s_async.Configuration())
    assert isinstance(api, k8s_async.ApiClient)
    api.__class__ = type("Timed", (type(api), Recording), {})  # the provider's call_api first, then the recorder
    try:
        await api.call_api("/api/v1/namespaces", "GET", _request_timeout=None)
    finally:
        await api.close()
    assert sent and sent[0] is not None


@pytest.mark.parametrize(("name", "members"), [
    ("ParquetDatasink", ("write", "on_write_complete")),
    ("TaskContext", ("get_current",)),
    ("Batcher", ("add", "has_batch", "next_batch", "done_adding")),
    ("PlainRayHandler", ("emit",)),
    ("train_context", ("logger",)),
    ("GcsClient", ()),  # its methods are its inner client's; every local cluster of the Ray tier reads nodes with it
    ("jax_util", ("_create_sharding_1d", "_GLOBAL_MESH_1D_AXIS", "_convert_batch")),
])
def test_each_private_ray_name_is_where_ray_compat_looks_and_has_what_the_provider_uses(
        name: str, members: tuple[str, ...]) -> None:
    from airflow_provider_raytpu.workloads import ray_compat

    found = getattr(ray_compat, name)
    assert [member for member in members if not hasattr(found, member)] == []


def test_every_private_ray_name_is_checked_above() -> None:
    from airflow_provider_raytpu.workloads.ray_compat import PRIVATE_NAMES

    assert sorted(PRIVATE_NAMES) == ["Batcher", "GcsClient", "ParquetDatasink", "PlainRayHandler", "TaskContext",
                                     "jax_util", "train_context"]


def test_a_name_a_ray_upgrade_moved_fails_naming_the_module_to_update(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_raytpu.workloads import ray_compat

    monkeypatch.setitem(ray_compat.PRIVATE_NAMES, "Batcher", ("ray.data.block", "Batcher"))
    with pytest.raises(ImportError, match=r"has no ray.data.block.Batcher: the provider's Batcher moved in this Ray; "
                                          r"update airflow_provider_raytpu/workloads/ray_compat.py"):
        ray_compat.Batcher  # noqa: B018 - the lookup is what is tested
    with pytest.raises(AttributeError, match="has no attribute 'Unlisted'"):
        ray_compat.Unlisted  # noqa: B018
