"""The local backend on real Ray processes: one emulated v4 2x2x2 slice for the whole module.

The tests run in file order and share the module's cluster: READY, Ray's own slice
placement on it, adoption, whole-slice recreation after a host dies, and a delete that
stops exactly the cluster's processes. Refusals and failures on clusters of their own are in
test_local_failures.py; the pure plan in test_local_plan.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from airflow_provider_raytpu.backends.base import Applied
from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.backends.local.process import free_port, port_open
from airflow_provider_raytpu.errors import ConflictError
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import (
    CLUSTER_READY_TIMEOUT,
    TPU_LABELS,
    EmulatedCluster,
    alive,
    run_driver,
    watch_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("a_ray_token_in_home")]


def _pids(backend: LocalBackend, cluster: EmulatedCluster) -> dict[str, int]:
    state = backend.state(cluster.name, cluster.namespace)
    assert state is not None
    pids = {"supervisor": backend.supervisor(cluster.name, cluster.namespace)["pid"], "head": state["head"]["pid"]}
    for slice_ in state["slices"]:
        for host in slice_["hosts"]:
            pids[f"slice {slice_['index']} host {host['worker_id']}"] = host["pid"]
    return pids


@pytest.mark.timeout(300)
async def test_apply_reaches_ready_with_tpu_hosts_in_the_gcs(
    local_backend: LocalBackend, emulated_cluster: EmulatedCluster
) -> None:
    assert emulated_cluster.action == Applied.CREATED.value
    seen = await watch_until(
        local_backend, emulated_cluster.name, emulated_cluster.namespace,
        lambda s: s.phase in (Phase.READY, Phase.FAILED), CLUSTER_READY_TIMEOUT,
    )
    final = seen[-1]
    assert final.phase is Phase.READY, local_backend.diagnose_cluster(emulated_cluster.name, emulated_cluster.namespace)
    assert (final.head_ready, final.ready_hosts, final.desired_hosts) == (True, 2, 2)
    assert [(s.index, s.ready_hosts, s.hosts) for s in final.slices] == [("0", 2, 2)]

    gcs = local_backend.gcs_address(emulated_cluster.name, emulated_cluster.namespace)
    nodes = run_driver(gcs, "result = [n for n in ray.nodes() if n['Alive']]")
    tpu_hosts = [n for n in nodes if "TPU" in n["Resources"]]
    assert len(nodes) == 3 and len(tpu_hosts) == 2
    for node in tpu_hosts:
        resources, labels = node["Resources"], node["Labels"]
        assert resources["TPU"] == 4
        assert resources["emu-slice-0"] == 1
        assert resources["accelerator_type:TPU-V4"] == 1
        assert resources["CPU"] == 1
        assert resources["object_store_memory"] == 157286400
        assert {k: labels[k] for k in TPU_LABELS} == TPU_LABELS
    assert sorted(n["Labels"]["ray.io/tpu-worker-id"] for n in tpu_hosts) == ["0", "1"]
    heads = [n for n in tpu_hosts if n["Resources"].get("TPU-v4-16-head")]
    assert len(heads) == 1 and heads[0]["Labels"]["ray.io/tpu-worker-id"] == "0"

    assert "1 RayCluster(s), 1 with a running head" in local_backend.check()

    # The dashboard serves the Jobs and Serve REST APIs that later tasks use.
    import urllib.request

    url = local_backend.dashboard(emulated_cluster.name, emulated_cluster.namespace).url
    assert url.startswith("http://127.0.0.1:")
    for path in ("/api/jobs/", "/api/serve/applications/"):
        with urllib.request.urlopen(url + path, timeout=10) as answer:
            assert answer.status == 200, path


JOB_SCRIPT = textwrap.dedent(
    """
    import json, os
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from ray.util.tpu import slice_placement_group

    ray.init()
    slice_pg = slice_placement_group(topology="2x2x2", accelerator_version="v4")
    ray.get(slice_pg.placement_group.ready(), timeout=90)

    @ray.remote(num_cpus=0)
    def where():
        return {k: os.environ.get(k) for k in ("TPU_NAME", "TPU_WORKER_ID", "JAX_PLATFORMS")}

    seen = ray.get([
        where.options(
            resources={"TPU": slice_pg.devices_per_host},
            scheduling_strategy=PlacementGroupSchedulingStrategy(slice_pg.placement_group,
                                                                 placement_group_bundle_index=i),
        ).remote()
        for i in range(slice_pg.num_hosts)
    ], timeout=90)
    print("RAYTPU_RESULT " + json.dumps({"hosts": slice_pg.num_hosts, "selector": slice_pg.bundle_label_selector,
                                          "seen": seen}))
    slice_pg.shutdown()
    """
)


@pytest.mark.timeout(300)
def test_slice_placement_group_reserves_the_emulated_slice(
    local_backend: LocalBackend, emulated_cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """Run Ray's own slice reservation as a Ray job, through the dashboard's Jobs API."""
    import json

    from ray.job_submission import JobStatus, JobSubmissionClient

    script = tmp_path / "reserve_slice.py"
    script.write_text(JOB_SCRIPT)
    client = JobSubmissionClient(local_backend.dashboard(emulated_cluster.name, emulated_cluster.namespace).url)
    job_id = client.submit_job(entrypoint=f"{sys.executable} {script}")
    deadline = time.monotonic() + 240
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    result = json.loads([line for line in logs.splitlines() if line.startswith("RAYTPU_RESULT ")][-1].split(" ", 1)[1])
    assert result["hosts"] == 2
    assert result["selector"] == [{"ray.io/tpu-slice-name": "emu-slice-0"}] * 2
    assert sorted((s["TPU_NAME"], s["TPU_WORKER_ID"], s["JAX_PLATFORMS"]) for s in result["seen"]) == [
        ("emu-slice-0", "0", "cpu"),
        ("emu-slice-0", "1", "cpu"),
    ]


@pytest.mark.timeout(120)
def test_apply_again_adopts_and_a_different_spec_conflicts(
    local_backend: LocalBackend, emulated_cluster: EmulatedCluster
) -> None:
    before = _pids(local_backend, emulated_cluster)
    again = local_backend.apply_cluster(emulated_cluster.manifest)
    assert again.action is Applied.ADOPTED
    assert again.cluster["status"]["readyWorkerReplicas"] == 2

    # Concurrent retries take the lock in turn; neither starts a second supervisor.
    actions: list[Applied] = []
    threads = [
        threading.Thread(target=lambda: actions.append(local_backend.apply_cluster(emulated_cluster.manifest).action))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert actions == [Applied.ADOPTED, Applied.ADOPTED]
    assert _pids(local_backend, emulated_cluster) == before

    different = build_ray_cluster(name="emu", namespace="default", tpu=TpuSlice("v4", "2x2x2"),
                                  options=RayClusterOptions(env={"X": "1"}))
    with pytest.raises(ConflictError, match="update_if_exists"):
        local_backend.apply_cluster(different)
    assert _pids(local_backend, emulated_cluster) == before

    # Idle, the supervisor costs next to nothing.
    supervisor = psutil.Process(before["supervisor"])
    start = sum(supervisor.cpu_times()[:2])
    time.sleep(3)
    assert sum(supervisor.cpu_times()[:2]) - start < 0.3


@pytest.mark.timeout(300)
async def test_a_dead_host_makes_the_supervisor_recreate_the_whole_slice(
    local_backend: LocalBackend, emulated_cluster: EmulatedCluster
) -> None:
    name, namespace = emulated_cluster.name, emulated_cluster.namespace
    assert local_backend.cluster_status(name, namespace).phase is Phase.READY
    before = _pids(local_backend, emulated_cluster)
    host = psutil.Process(before["slice 0 host 1"])
    raylet = next(p for p in host.children(recursive=True) if p.name() == "raylet")
    os.kill(raylet.pid, signal.SIGKILL)

    left = await watch_until(local_backend, name, namespace, lambda s: s.phase is not Phase.READY, 60)
    assert left[-1].phase is Phase.PROVISIONING
    assert left[-1].slices[0].index == "0" and left[-1].slices[0].ready_hosts < 2
    assert "slice 0" in left[-1].message
    diagnosis = local_backend.diagnose_cluster(name, namespace)
    assert "PROVISIONING" in diagnosis and "slice 0" in diagnosis

    back = await watch_until(local_backend, name, namespace, lambda s: s.phase in (Phase.READY, Phase.FAILED), 180)
    assert back[-1].phase is Phase.READY, local_backend.diagnose_cluster(name, namespace)
    after = _pids(local_backend, emulated_cluster)
    assert after["supervisor"] == before["supervisor"] and after["head"] == before["head"]
    assert after["slice 0 host 0"] != before["slice 0 host 0"]
    assert after["slice 0 host 1"] != before["slice 0 host 1"]
    assert not alive(before["slice 0 host 0"]) and not alive(before["slice 0 host 1"])
    state = local_backend.state(name, namespace)
    assert state["slices"][0]["restarts"] == 1

    # The GCS agrees: exactly the two new raylets are the alive TPU hosts.
    from ray._raylet import GcsClient

    infos = GcsClient(address=state["gcs_address"]).get_all_node_info(timeout=10).values()
    alive_tpu = {i.node_id.hex() for i in infos if i.state == 0 and "TPU" in i.resources_total}
    assert alive_tpu == {h["node_id"] for h in state["slices"][0]["hosts"]}


@pytest.mark.timeout(180)
def test_delete_stops_exactly_the_clusters_processes(
    local_backend: LocalBackend, emulated_cluster: EmulatedCluster
) -> None:
    name, namespace = emulated_cluster.name, emulated_cluster.namespace
    # An unrelated Ray cluster on the same machine must survive (no `ray stop`).
    other_temp = Path(f"/tmp/rt-other-{secrets.token_hex(4)}")
    other_port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={other_port}", "--num-cpus=0",
         "--include-dashboard=false", f"--temp-dir={other_temp}", "--object-store-memory=78643200",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--disable-usage-stats", "--block"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    try:
        deadline = time.monotonic() + 90
        while not port_open(other_port):
            assert other.poll() is None and time.monotonic() < deadline, "the unrelated Ray head did not start"
            time.sleep(0.5)
        other_tree = [other.pid] + [p.pid for p in psutil.Process(other.pid).children(recursive=True)]

        state = local_backend.state(name, namespace)
        supervisor = local_backend.supervisor(name, namespace)
        recorded = list(_pids(local_backend, emulated_cluster).values())
        everything = local_backend.cluster_processes(name, namespace)
        assert set(recorded) <= set(everything) and len(everything) > 10
        cluster_dir = local_backend.cluster_dir(name, namespace)

        assert local_backend.delete_cluster(name, namespace) is True

        assert [pid for pid in everything if alive(pid)] == []
        group = [pid for pid in psutil.pids() if alive(pid) and _group_and_session(pid) & {supervisor["pgid"]}]
        assert group == []
        assert all(alive(pid) for pid in other_tree)
        assert not cluster_dir.exists() and not Path(state["temp_dir"]).exists()
        assert local_backend.get_cluster(name, namespace) is None
        assert local_backend.cluster_status(name, namespace).phase is Phase.GONE
        assert local_backend.list_clusters(namespace, "") == []
        assert local_backend.delete_cluster(name, namespace) is False
    finally:
        other.terminate()
        try:
            other.wait(30)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()
        shutil.rmtree(other_temp, ignore_errors=True)


def _group_and_session(pid: int) -> set[int]:
    try:
        return {os.getpgid(pid), os.getsid(pid)}
    except OSError:
        return set()
