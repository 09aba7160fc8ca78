"""The private Airflow names in airflow_provider_raytpu/compat.py still exist and still behave as the provider
needs: an upgrade that moves or changes one fails here."""

from __future__ import annotations

from airflow_provider_raytpu.compat import redact
from airflow_provider_raytpu.operators.base import mask_secret_values


def test_redact_hides_the_values_of_keys_that_look_secret() -> None:
    assert redact({"api_key": "k-8c1f0e2a", "steps": 3, "nested": {"password": ["p-44aa21", "p-55bb32"]}}) == {
        "api_key": "***", "steps": 3, "nested": {"password": ["***", "***"]}}


def test_a_registered_value_is_what_a_trigger_carries_and_is_hidden_in_any_text() -> None:
    config = {"lr": 0.1, "hf_token": "hf-3b9d7c1e55", "data": {"db_password": "pw-71c2e9d0"}, "name": "run-a"}
    assert mask_secret_values(config) == ["hf-3b9d7c1e55", "pw-71c2e9d0"]
    assert redact("loaded hf-3b9d7c1e55 and pw-71c2e9d0 for run-a") == "loaded *** and *** for run-a"
    assert mask_secret_values(None) == mask_secret_values({}) == []
