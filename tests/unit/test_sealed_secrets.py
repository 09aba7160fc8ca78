"""A job task's secrets travel to the triggerer sealed with Airflow's Fernet key: Airflow 3 stores a trigger's
arguments as the task sends them (plain JSON in the trigger table)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from airflow.sdk.crypto import get_fernet

from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.triggers.ray_job import RayJobTrigger, seal_secrets, unseal_secrets


@pytest.fixture
def fresh_fernet() -> Iterator[None]:
    get_fernet.cache_clear()  # Airflow reads the key once per process
    yield
    get_fernet.cache_clear()


def test_sealed_secrets_are_unreadable_in_the_trigger_arguments_and_open_in_the_triggerer(fresh_fernet: None) -> None:
    sealed = seal_secrets(["hf-3b9d7c1e55", "pw-71c2e9d0"])
    assert sealed is not None and "hf-3b9d7c1e55" not in sealed
    trigger = RayJobTrigger("job-1", "train", "ml", "raytpu_default", sealed_secrets=sealed)
    assert trigger.serialize()[1]["sealed_secrets"] == sealed and "hf-3b9d7c1e55" not in repr(trigger)
    assert unseal_secrets(sealed) == ["hf-3b9d7c1e55", "pw-71c2e9d0"]
    assert seal_secrets([]) is None and unseal_secrets(None) == []


def test_a_fernet_key_that_is_not_one_is_named_with_the_fix(fresh_fernet: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "{FERNET_KEY}")
    with pytest.raises(FatalError) as info:
        seal_secrets(["hf-3b9d7c1e55"])
    assert str(info.value).startswith("Airflow's [core] fernet_key cannot seal the task's secrets for the triggerer")
    assert "Fernet.generate_key()" in str(info.value) and "hf-3b9d7c1e55" not in str(info.value)


def test_a_triggerer_with_another_key_ends_the_wait_instead_of_following_the_job_unmasked(
        fresh_fernet: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from cryptography.fernet import Fernet

    sealed = seal_secrets(["hf-3b9d7c1e55"])
    get_fernet.cache_clear()
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", Fernet.generate_key().decode())

    async def first_event() -> dict:
        async for event in RayJobTrigger("job-1", "train", "ml", "raytpu_default", sealed_secrets=sealed).run():
            return event.payload
        raise AssertionError("no event")

    event = asyncio.run(first_event())
    assert event["status"] == "ERROR" and "cannot unseal the task's secrets (InvalidToken)" in event["message"]
