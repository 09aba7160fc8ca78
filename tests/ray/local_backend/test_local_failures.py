"""The local backend's refusals and failures, each on a cluster of its own (real Ray processes): a slice too
large for the machine refused before anything starts, two creates at once then a lost supervisor, a head
that cannot start."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.backends.local.plan import plan_cluster
from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import alive, watch_until

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("a_ray_token_in_home")]


@pytest.mark.timeout(60)
def test_a_slice_too_large_for_the_machine_is_refused_before_anything_starts(
    local_backend: LocalBackend, raytpu_home: Path
) -> None:
    manifest = build_ray_cluster(name="too-big", namespace="default", tpu=TpuSlice("v4", "4x4x4"))
    with pytest.raises(InvalidInputError) as caught:
        local_backend.apply_cluster(manifest)
    message = str(caught.value)
    assert "topology='4x4x4'" in message and "16 TPU hosts" in message and "local_max_hosts=8" in message
    assert "smaller topology" in message
    assert not local_backend.cluster_dir("too-big", "default").exists()
    assert local_backend.get_cluster("too-big", "default") is None
    assert local_backend.cluster_status("too-big", "default").phase is Phase.GONE

    # The limit is the connection's to raise.
    roomy = ConnectionSettings.from_extra("raytpu_default", {"backend": "local", "local_home": str(raytpu_home),
                                                             "local_max_hosts": "16"})
    assert plan_cluster(manifest, roomy.local_max_hosts).total_hosts == 16

    # A worker group edited away from the slice annotation is refused too.
    edited = build_ray_cluster(name="edited", namespace="default", tpu=TpuSlice("v4", "2x2x2"))
    edited["spec"]["workerGroupSpecs"][0]["numOfHosts"] = 3
    with pytest.raises(InvalidInputError, match="numOfHosts"):
        local_backend.apply_cluster(edited)
    assert not local_backend.cluster_dir("edited", "default").exists()


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


@pytest.mark.timeout(180)
def test_concurrent_creates_start_one_supervisor_and_an_orphaned_cluster_is_cleaned_up(
    local_backend: LocalBackend,
) -> None:
    """Two simultaneous applies of a new cluster: one creates, one adopts; then the supervisor is
    killed (status FAILED, as with a lost operator) and delete still finds every process."""
    manifest = build_ray_cluster(name="race", namespace="other", tpu=TpuSlice("v4", "2x2x1"))
    try:
        actions: list[Applied] = []
        threads = [threading.Thread(target=lambda: actions.append(local_backend.apply_cluster(manifest).action))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(a.value for a in actions) == ["adopted", "created"]
        assert [c["metadata"]["name"]
                for c in local_backend.list_clusters("other", "app.kubernetes.io/managed-by")] == ["race"]
        supervisor = local_backend.supervisor("race", "other")
        supervisors = [
            pid for pid in psutil.pids()
            if "airflow_provider_raytpu.backends.local.supervisor" in (command := " ".join(_cmdline(pid)))
            and str(local_backend.cluster_dir("race", "other")) in command
        ]
        assert supervisors == [supervisor["pid"]]

        # Once the head's GCS runs, lose the supervisor.
        deadline = time.monotonic() + 90
        while "gcs_server" not in {_name(pid) for pid in local_backend.cluster_processes("race", "other")}:
            assert time.monotonic() < deadline, local_backend.diagnose_cluster("race", "other")
            time.sleep(0.5)
        everything = local_backend.cluster_processes("race", "other")
        temp_dir = Path(local_backend.state("race", "other")["temp_dir"])
        os.kill(supervisor["pid"], signal.SIGKILL)
        psutil.Process(supervisor["pid"]).wait(10)
        status = local_backend.cluster_status("race", "other")
        assert status.phase is Phase.FAILED and status.reason == "SupervisorNotRunning"
        assert "supervisor" in local_backend.diagnose_cluster("race", "other")

        assert local_backend.delete_cluster("race", "other") is True
        assert [pid for pid in everything if alive(pid)] == []
        assert not temp_dir.exists()
        assert local_backend.cluster_status("race", "other").phase is Phase.GONE
    finally:
        local_backend.delete_cluster("race", "other")


@pytest.mark.timeout(120)
async def test_a_head_that_cannot_start_makes_the_cluster_failed_with_its_log(
    local_backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYTPU_LOCAL_MAX_FAILED_STARTS", "1")  # read by the supervisor: fail on the first try
    manifest = build_ray_cluster(
        name="broken", namespace="default", tpu=TpuSlice("v4", "2x2x1"),
        options=RayClusterOptions(head_ray_start_params={"resources": '"{\\"x\\": -1}"'}),
    )
    assert local_backend.apply_cluster(manifest).action is Applied.CREATED
    try:
        seen = await watch_until(local_backend, "broken", "default", lambda s: s.finished, 90)
        assert seen[-1].phase is Phase.FAILED and seen[-1].reason == "HeadFailed"
        diagnosis = await local_backend.adiagnose_cluster("broken", "default")
        assert "Resource quantities must be nonnegative" in diagnosis
    finally:
        assert local_backend.delete_cluster("broken", "default") is True
