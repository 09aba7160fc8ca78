"""How long a local cluster lives: recreated on a spec change, stopped at its expiry, swept by the janitor.

Real Ray processes (one emulated v4 2x2x1 slice: a head and one host per cluster).
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import (
    EXPIRES_AT_ANNOTATION,
    AirflowOrigin,
    build_ray_cluster,
    parse_expiry,
)
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import CLUSTER_READY_TIMEOUT, watch_until
from tests.support.airflow_runner import run_dag

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

ORIGIN = AirflowOrigin("lifetime", "manual__2026-12-02T00:00:00+00:00", "create_cluster")


def alive(pids: list[int]) -> list[int]:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [pid for pid in pids if running(pid)]


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


async def test_a_spec_change_with_update_if_exists_recreates_the_cluster(local_backend: LocalBackend) -> None:
    first = build_ray_cluster(name="life", namespace="default", tpu=TpuSlice("v4", "2x2x1"), origin=ORIGIN)
    assert local_backend.apply_cluster(first).action is Applied.CREATED
    try:
        await watch_until(local_backend, "life", "default", lambda s: s.phase is Phase.READY, CLUSTER_READY_TIMEOUT)
        before = local_backend.cluster_processes("life", "default")
        incarnation = local_backend.supervisor("life", "default")["incarnation"]
        changed = build_ray_cluster(name="life", namespace="default", tpu=TpuSlice("v4", "2x2x1"), origin=ORIGIN,
                                    options=RayClusterOptions(env={"MODEL": "v2"}))
        assert local_backend.apply_cluster(changed, update_if_exists=True).action is Applied.RECREATED
        assert alive(before) == [], "the old cluster's processes are gone before the new one starts"
        assert local_backend.supervisor("life", "default")["incarnation"] != incarnation
        seen = await watch_until(local_backend, "life", "default", lambda s: s.phase is Phase.READY,
                                 CLUSTER_READY_TIMEOUT)
        assert seen[-1].ready_hosts == 1
        stored = local_backend.get_cluster("life", "default")
        assert stored["metadata"]["generation"] == 1, "a new object, not the old one updated"
        assert stored["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"] == [
            {"name": "MODEL", "value": "v2"}]
    finally:
        local_backend.delete_cluster("life", "default")


JANITOR = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import DeleteExpiredRayClustersOperator

with DAG("local_janitor", schedule=None, start_date=datetime(2026, 1, 1)):
    DeleteExpiredRayClustersOperator(task_id="delete_expired")
'''


def test_an_expired_cluster_stops_by_itself_and_the_janitor_removes_it(
        airflow_home: Path, local_backend: LocalBackend, raytpu_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DAG that died before its teardown (a killed worker) must not leave Ray running on this machine."""
    expires = datetime.now(UTC) + timedelta(seconds=20)
    manifest = build_ray_cluster(name="expiring", namespace="default", tpu=TpuSlice("v4", "2x2x1"), origin=ORIGIN,
                                 expires_at=expires)
    local_backend.apply_cluster(manifest)
    try:
        supervisor = local_backend.supervisor("expiring", "default")["pid"]
        assert alive([supervisor])
        # Every process it ever had: sampled until the expiry, as the head and host start.
        everything: set[int] = set()
        while datetime.now(UTC) < expires:
            everything.update(local_backend.cluster_processes("expiring", "default"))
            time.sleep(1)
        assert wait_until_gone([supervisor, *everything], 120) == []
        status = local_backend.cluster_status("expiring", "default")
        assert status.phase is Phase.FAILED and status.reason == "Expired", status

        monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps(
            {"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
        outcome = run_dag(airflow_home, JANITOR, "local_janitor")["delete_expired"]
        assert (outcome.state, outcome.result) == ("success", ["default/expiring"])
        assert local_backend.get_cluster("expiring", "default") is None
    finally:
        local_backend.delete_cluster("expiring", "default")


RENEWED = '''
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("local_renewal", schedule=None, start_date=datetime(2026, 1, 1)):
    CreateRayClusterOperator(task_id="create_cluster", cluster_name="renewed", accelerator="v4", topology="2x2x1",
                             max_lifetime=LIFETIME)
'''


def test_a_create_that_adopts_its_cluster_renews_its_expiry(
        airflow_home: Path, local_backend: LocalBackend, raytpu_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Clear of the create task adopts the cluster: its supervisor keeps it past the old expiry."""
    monkeypatch.setenv("AIRFLOW_CONN_RAYTPU_DEFAULT", json.dumps(
        {"conn_type": "raytpu", "extra": {"backend": "local", "local_home": str(raytpu_home)}}))
    logical_date = datetime(2026, 12, 2, tzinfo=UTC)
    try:
        first = run_dag(airflow_home, RENEWED.replace("LIFETIME", "20"), "local_renewal", logical_date=logical_date)
        assert first["create_cluster"].state == "success"
        supervisor = local_backend.supervisor("renewed", "default")["pid"]
        first_expiry = parse_expiry(
            local_backend.get_cluster("renewed", "default")["metadata"]["annotations"][EXPIRES_AT_ANNOTATION])
        again = run_dag(airflow_home, RENEWED.replace("LIFETIME", "3600"), "local_renewal", logical_date=logical_date)
        assert again["create_cluster"].state == "success"
        notes = local_backend.get_cluster("renewed", "default")["metadata"]["annotations"]
        assert notes["raytpu.dev/expires-at"] > (datetime.now(UTC) + timedelta(minutes=55)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        time.sleep(max(0.0, (first_expiry - datetime.now(UTC)).total_seconds()) + 5)  # past the first expiry
        assert alive([supervisor]), "the supervisor kept the adopted cluster"
        assert local_backend.cluster_status("renewed", "default").phase is not Phase.FAILED
    finally:
        local_backend.delete_cluster("renewed", "default")


def test_a_supervisor_whose_state_directory_is_removed_stops_its_cluster(local_backend: LocalBackend) -> None:
    """A killed test run's temp home removed from under a running cluster: nothing of it runs on."""
    local_backend.apply_cluster(build_ray_cluster(name="orphan", namespace="default", tpu=TpuSlice("v4", "2x2x1")))
    supervisor = local_backend.supervisor("orphan", "default")["pid"]
    deadline = time.monotonic() + CLUSTER_READY_TIMEOUT
    while len(local_backend.cluster_processes("orphan", "default")) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    everything = local_backend.cluster_processes("orphan", "default")
    shutil.rmtree(local_backend.cluster_dir("orphan", "default"))
    assert wait_until_gone([supervisor, *everything], 120) == []
