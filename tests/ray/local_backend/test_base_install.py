"""The provider as an Airflow image installs it: ``pip install airflow-provider-raytpu`` brings no Ray.

A fresh virtualenv gets the base package (no extras) with the project's constraints; Ray is
not importable there. Its Airflow runs a Ray job task (deferred, so the trigger's async side
runs too) on a real Ray head, reached as on GKE: a RayCluster of a Kubernetes API, its
dashboard behind the API server's service proxy. The job ships a local ``working_dir`` and a
local ``py_modules`` package, and the provider's own package, as the example DAGs do; the
cluster holds them under the names Ray's own client gives them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import get_uri_for_directory
from ray.job_submission import JobSubmissionClient

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.manifests.raycluster import build_ray_cluster
from airflow_provider_raytpu.status import Phase
from airflow_provider_raytpu.tpu import TpuSlice
from tests.ray.local_backend.emulated import CLUSTER_READY_TIMEOUT, EmulatedCluster, watch_until
from tests.ray.local_backend.jobs import behind_the_api_server_proxy, task_jobs

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
UV = Path(sys.executable).parent / "uv"

DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.ray_job import SubmitRayJobOperator

CODE = \'\'\'
import json, os, pathlib
import greeting
import airflow_provider_raytpu.workloads.result as shipped
print("RAYTPU_RESULT " + json.dumps({"greeting": greeting.HELLO, "rows": pathlib.Path("rows.txt").read_text(),
      "ignored_shipped": os.path.exists("scratch.log"), "provider_from": shipped.__file__}))
\'\'\'

with DAG("base_install", schedule=None, start_date=datetime(2026, 1, 1)):
    SubmitRayJobOperator(task_id="job", cluster_name="emu", raytpu_conn_id="raytpu_k8s", poll_interval=0.5,
                         entrypoint=["python", "-c", CODE],
                         runtime_env={"working_dir": WORKING_DIR, "py_modules": [MODULE]})
"""

#: Run in the fresh virtualenv: the DAG with ``dag.test()`` (the trigger runs in-process), then what it returned.
RUN = """
import importlib.util, json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.utils import db

db.initdb()
run = DagBag(dag_folder=sys.argv[1]).dags["base_install"].test()
(ti,) = run.get_task_instances()
print("OUTCOME " + json.dumps({"state": str(ti.state), "result": ti.xcom_pull(task_ids="job"),
                               "ray_installed": importlib.util.find_spec("ray") is not None}))
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the base package installed as a user installs it (no extras, not editable)."""
    venv = tmp_path_factory.mktemp("base-venv") / "venv"
    subprocess.run([str(UV), "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    # --reinstall-package: uv would reuse a wheel it built of this directory before (its cache keys on pyproject.toml)
    subprocess.run([str(UV), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
                    "--reinstall-package", "airflow-provider-raytpu", "-c", str(REPO / "constraints.txt"), str(REPO)],
                   check=True, cwd=venv.parent)
    return venv


@pytest.fixture(scope="module")
def cluster(local_backend: LocalBackend) -> Iterator[EmulatedCluster]:
    """One emulated single-host v6e 2x2 slice: a real Ray head with its dashboard, READY."""
    manifest = build_ray_cluster(name="emu", namespace="default", tpu=TpuSlice("v6e", "2x2"))
    local_backend.apply_cluster(manifest)
    asyncio.run(watch_until(local_backend, "emu", "default", lambda s: s.phase is Phase.READY, CLUSTER_READY_TIMEOUT))
    yield EmulatedCluster("emu", "default", manifest, "created")
    local_backend.delete_cluster("emu", "default")


def test_a_job_task_runs_from_a_base_install_without_ray(base_venv: Path, cluster: EmulatedCluster,
                                                         local_backend: LocalBackend, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    python = base_venv / "bin" / "python"
    provider = Path(subprocess.run([str(python), "-c", "import airflow_provider_raytpu as p; print(p.__path__[0])"],
                                   capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip())
    assert provider.is_relative_to(base_venv), "the installed package, not this checkout"
    working_dir, module = tmp_path / "job", tmp_path / "lib" / "greeting"
    for path, text in {working_dir / "rows.txt": "3 rows", working_dir / ".gitignore": "*.log\n",
                       working_dir / "scratch.log": "not shipped", module / "__init__.py": "HELLO = 'hi from lib'\n"
                       }.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "base_install.py").write_text(DAG.replace("WORKING_DIR", repr(str(working_dir))).replace(
        "MODULE", repr(str(module))))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
                "PATH": f"{base_venv / 'bin'}:{env['PATH']}"})

    with behind_the_api_server_proxy(local_backend, cluster, monkeypatch) as kube:
        env.update({key: os.environ[key] for key in ("AIRFLOW_CONN_KUBE_PROXY", "AIRFLOW_CONN_RAYTPU_K8S")})
        done = subprocess.run([str(python), "-c", RUN, str(home / "dags")], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        proxied_uploads = kube.count("PUT", r"/services/emu-head-svc:dashboard/proxy/api/packages/gcs/")
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(lines[-1].removeprefix("OUTCOME "))
    assert outcome["ray_installed"] is False
    assert outcome["state"] == "success", done.stdout[-3000:]
    result = outcome["result"]
    assert (result["greeting"], result["rows"], result["ignored_shipped"]) == ("hi from lib", "3 rows", False)

    # The cluster holds each package under the name Ray's own client gives it (so either client reuses it).
    jobs = JobSubmissionClient(local_backend.dashboard(cluster.name, cluster.namespace).url)
    (job,) = task_jobs(jobs, "base_install")
    env_sent = job.runtime_env
    provider_uri = get_uri_for_directory(str(provider), include_gitignore=True, excludes=[])
    assert env_sent["working_dir"] == get_uri_for_directory(
        str(working_dir), include_gitignore=True, excludes=[".git", ".venv", "venv", "__pycache__"])
    assert env_sent["py_modules"] == [get_uri_for_directory(str(module), include_gitignore=True, excludes=[]),
                                      provider_uri]
    assert provider_uri.removeprefix("gcs://").removesuffix(".zip") in result["provider_from"]
    assert proxied_uploads == 3, "each package went up once, through the API server's proxy"


LOCAL_CREATE = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_provider_raytpu.operators.raycluster import CreateRayClusterOperator

with DAG("base_install_local", schedule=None, start_date=datetime(2026, 1, 1), default_args={"retries": 2}):
    CreateRayClusterOperator(task_id="create_cluster", accelerator="v6e", topology="2x2")
"""
RUN_CREATE = RUN.replace('"base_install"', '"base_install_local"').replace(
    'xcom_pull(task_ids="job")', 'try_number')


def test_the_local_backend_without_ray_fails_the_create_task_naming_the_extra(base_venv: Path,
                                                                             tmp_path: Path) -> None:
    python = base_venv / "bin" / "python"
    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "base_install_local.py").write_text(LOCAL_CREATE)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
                "AIRFLOW_CONN_RAYTPU_DEFAULT": json.dumps({"conn_type": "raytpu", "extra": {
                    "backend": "local", "local_home": str(tmp_path / "raytpu")}})})
    done = subprocess.run([str(python), "-c", RUN_CREATE, str(home / "dags")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(lines[-1].removeprefix("OUTCOME "))
    assert (outcome["state"], outcome["result"], outcome["ray_installed"]) == ("failed", 1, False), outcome
    assert "The local backend runs Ray on this machine, but Ray is not installed in " in done.stdout
    assert "pip install 'airflow-provider-raytpu[local]'" in done.stdout
    assert not (tmp_path / "raytpu" / "clusters").exists() or not any((tmp_path / "raytpu" / "clusters").rglob(
        "*.json")), "nothing was written for the cluster"
