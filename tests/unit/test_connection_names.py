"""The ``raytpu`` connection's field names: none that Airflow hides, and the renamed ones still read with a warning."""

from __future__ import annotations

import json

import pytest
from airflow._shared.secrets_masker import should_hide_value_for_key
from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.get_provider_info import CONN_FIELDS
from airflow_provider_raytpu.hooks.raytpu import RayTpuHook
from airflow_provider_raytpu.hooks.renamed_fields import RENAMED_FLAGS


def test_airflow_shows_every_connection_field_as_entered() -> None:
    """The API server redacts the extras with this function: a flag it hides comes back from the form as ``***``."""
    fields = {f for f in ConnectionSettings.__dataclass_fields__ if f != "conn_id"}
    assert set(CONN_FIELDS) <= fields
    assert [f for f in fields if should_hide_value_for_key(f)] == []
    assert all(should_hide_value_for_key(old) for old in RENAMED_FLAGS)  # why each was renamed


def _hook(monkeypatch: pytest.MonkeyPatch, extra: dict[str, object]) -> RayTpuHook:
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_RENAMED", json.dumps({"conn_type": "raytpu", "extra": extra}))
    return RayTpuHook("raytpu_renamed")


@pytest.mark.parametrize("old_value", ["false", False])
def test_the_old_name_of_ray_auth_still_works_and_warns_naming_the_new_one(monkeypatch: pytest.MonkeyPatch,
                                                                            old_value: object) -> None:
    hook = _hook(monkeypatch, {"backend": "kubernetes", "ray_token_auth": old_value})
    with pytest.warns(AirflowProviderDeprecationWarning,
                      match=r"'raytpu_renamed' sets extra.ray_token_auth, which is deprecated: rename it to "
                            r"extra.ray_auth"):
        settings = hook.settings
    assert settings.ray_auth is False


def test_both_names_agreeing_read_as_one_and_contradicting_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(AirflowProviderDeprecationWarning):
        agreeing = _hook(monkeypatch, {"backend": "kubernetes", "ray_token_auth": "false", "ray_auth": False}).settings
    assert agreeing.ray_auth is False
    with pytest.warns(AirflowProviderDeprecationWarning), pytest.raises(InvalidInputError) as info:
        _ = _hook(monkeypatch, {"backend": "kubernetes", "ray_token_auth": "false", "ray_auth": "true"}).settings
    assert str(info.value) == ("connection 'raytpu_renamed' extra.ray_token_auth='false': contradicts "
                               "extra.ray_auth='true', which replaces it. Remove extra.ray_token_auth and keep "
                               "extra.ray_auth")


def test_the_new_name_alone_reads_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", AirflowProviderDeprecationWarning)
        assert _hook(monkeypatch, {"backend": "kubernetes", "ray_auth": "false"}).settings.ray_auth is False
    assert ConnectionSettings.from_extra("c", {"backend": "kubernetes"}).ray_auth is True
