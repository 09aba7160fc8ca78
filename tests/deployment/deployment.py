"""A real Airflow deployment on this machine: ``api-server``, ``scheduler``, ``dag-processor`` and
``triggerer`` as separate processes from this interpreter's venv, LocalExecutor on SQLite, a private
``AIRFLOW_HOME``, and the local ``raytpu`` backend with its own state directory.

Each component is started in a session of its own, so stopping it signals its whole process
group by the PID we started (the scheduler's executor workers and their task processes, the
triggerer's runner); local Ray clusters run under supervisors in sessions of their own and are
deleted through the local backend. Every component's output goes to a log file kept for failure
messages (:meth:`AirflowDeployment.diagnostics`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from airflow_provider_raytpu.backends.local import LocalBackend
from airflow_provider_raytpu.backends.local.process import all_processes, kill_processes, tail
from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.status import Phase
from tests.deployment.rest import AirflowApi
from tests.support.processes import Component, free_ports

REPO = Path(__file__).resolve().parents[2]
NODE_GATE = Path(__file__).resolve().parent / "site"  # sitecustomize.py: cluster nodes wait for the test's gate
AIRFLOW = str(Path(sys.executable).parent / "airflow")
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# What /api/v2/monitor/health calls each component.
HEALTH_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
PASSWORD_FILE = "simple_auth_manager_passwords.json.generated"


class DeploymentError(RuntimeError):
    """A component did not start, died, or the deployment did not become ready."""


class AirflowComponent(Component):
    """One Airflow command; stopping it signals its whole process group (the PID is the group id)."""

    def signal_group(self, signum: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait up to ``timeout`` for the leader, then SIGKILL the group."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.signal_group(signal.SIGKILL)  # what the leader left behind (executor workers, task processes)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the group at once: a crash, no graceful shutdown."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


class AirflowDeployment:
    """Airflow's four components on 127.0.0.1 with a private home under ``root``.

    :param root: an empty directory for ``AIRFLOW_HOME``, the logs and the local backend's state.
    :param dags_folder: the DAG folder the dag-processor parses.
    :param env: extra environment for every component (and the Ray processes the tasks start).
    """

    def __init__(self, root: Path, dags_folder: Path, env: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.home = root / "airflow"
        self.raytpu_home = root / "raytpu"
        self.log_dir = root / "component-logs"
        for path in (self.home, self.raytpu_home, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.dags_folder = dags_folder
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = self._environment(env or {})
        self.components: dict[str, AirflowComponent] = {}
        self.api: AirflowApi | None = None
        self._starts: dict[str, int] = {}

    def _environment(self, extra: Mapping[str, str]) -> dict[str, str]:
        if not (NODE_GATE / "sitecustomize.py").is_file():
            raise DeploymentError(f"{NODE_GATE / 'sitecustomize.py'} is missing: without it a test's gate file holds "
                                  "no cluster node back and the deferral tests depend on timing (restore it from git)")
        # Nothing of the test process's own Airflow setup (tests/conftest.py) leaks in.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != "RAY_ADDRESS"}
        python_path = os.pathsep.join(p for p in (str(REPO), str(NODE_GATE), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **inherited,
            "PYTHONPATH": python_path,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "8",
            # A component waits up to 60 s for SQLite's write lock, not pysqlite's 5 s (Airflow already journals
            # ahead, PRAGMA journal_mode=WAL): beside the control-plane tier, the audit-log write of an asset event
            # POST waited 5 s behind a task's write and failed it (500, database is locked).
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db?timeout=60",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            # One secret for every component: the workers' execution-API tokens must verify.
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
            "AIRFLOW__CORE__FERNET_KEY": _fernet_key(),
            "AIRFLOW__CORE__TEST_CONNECTION": "Enabled",
            # Beside the control-plane tier, one api-server worker on SQLite once took 37 s to answer a task's
            # start; at the default 5 s a worker's five tries ran out and the task failed before it began.
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",  # there is a triggerer
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
            # The tier never edits a DAG file (a new or changed one is parsed at once either way): parsing the 11
            # unchanged files every 30 s took a fifth of a core (223 s of parser CPU in 27 min).
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "900",
            # A triggerer that stopped heartbeating hands its triggers on after 15 s, not 30.
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
            "RAYTPU_HOME": str(self.raytpu_home),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DATA_USAGE_DISABLED": "1",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
            "JAX_PLATFORMS": "cpu",
            **extra,
        }

    # -- processes ------------------------------------------------------------------------------

    def migrate(self) -> None:
        """``airflow db migrate`` into the private SQLite database."""
        log = self.log_dir / "db-migrate.log"
        with log.open("w") as out:
            done = subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=300)
        if done.returncode != 0:
            raise DeploymentError(f"airflow db migrate failed ({done.returncode}):\n{tail(log, 60)}")

    def start(self, name: str) -> AirflowComponent:
        """Start ``airflow <name>``; each start logs to a file of its own (``triggerer-2.log`` after a restart)."""
        if name in self.components and self.components[name].alive():
            raise DeploymentError(f"{name} is already running (pid {self.components[name].pid})")
        self._starts[name] = self._starts.get(name, 0) + 1
        suffix = "" if self._starts[name] == 1 else f"-{self._starts[name]}"
        component = AirflowComponent(name, [AIRFLOW, name], self.log_dir / f"{name}{suffix}.log", env=self.env)
        component.spawn()
        self.components[name] = component
        return component

    def stop(self, name: str) -> None:
        """Stop a component gracefully (SIGTERM to its group, SIGKILL after 30 s)."""
        self.components[name].stop()

    def kill(self, name: str) -> None:
        """Kill a component's whole process group with SIGKILL, as a crash or an OOM kill would."""
        self.components[name].kill()

    def stop_all(self) -> None:
        """Stop every component, the scheduler first (so no new task starts), the api-server last."""
        for name in ("scheduler", "triggerer", "dag-processor", "api-server"):
            if name in self.components:
                self.components[name].stop()

    def check_alive(self) -> None:
        """Raise with the component's log tail if any started component has exited."""
        for name, component in self.components.items():
            if not component.alive():
                code = component.proc.returncode if component.proc else None
                raise DeploymentError(f"airflow {name} exited ({code}); last lines of {component.log_path}:\n"
                                      f"{component.log_tail(60)}")

    # -- readiness ------------------------------------------------------------------------------

    def health(self) -> dict[str, dict[str, str | None]] | None:
        """``/api/v2/monitor/health`` (no login needed), or ``None`` while the api-server is not answering."""
        try:
            response = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_healthy(self, names: tuple[str, ...] = COMPONENTS, timeout: float = 180.0) -> None:
        """Wait until the api-server answers and each named component reports a healthy heartbeat."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            health = self.health()
            if health is not None:
                pending = [n for n in names if n in HEALTH_KEYS and health[HEALTH_KEYS[n]]["status"] != "healthy"]
                if not pending:
                    return
            if time.monotonic() > deadline:
                raise DeploymentError(f"not healthy after {timeout:.0f} s: {health}\n{self.diagnostics()}")
            time.sleep(1)

    def admin_password(self) -> str:
        """The admin password the simple auth manager generated at the api-server's first start."""
        path = self.home / PASSWORD_FILE
        passwords = json.loads(path.read_text())
        return passwords["admin"]

    def login(self) -> AirflowApi:
        """Log in as the admin; the client is kept as :attr:`api`."""
        self.api = AirflowApi(self.url, "admin", self.admin_password(), on_timeout=self.diagnostics)
        return self.api

    def restart_triggerer(self, *, crash: bool) -> None:
        """Stop the triggerer (SIGKILL when ``crash``, else a graceful SIGTERM), start a new one and
        wait until its job heartbeats."""
        before = {job["id"] for job in self.api.live_jobs("TriggererJob")}
        if crash:
            self.kill("triggerer")
        else:
            self.stop("triggerer")
        self.start("triggerer")
        self.api.wait("a new triggerer job", lambda: {j["id"] for j in self.api.live_jobs("TriggererJob")} - before,
                      120, check=self.check_alive)

    def kill_strays(self, grace: float = 10.0) -> list[str]:
        """Kill every process still carrying this deployment's Airflow home, or its local backend's home (a
        local cluster's processes get no Airflow variables), in its environment; describe each."""
        import psutil

        strays = []
        for process in all_processes():
            with contextlib.suppress(psutil.Error):
                environ = process.environ()
                if environ.get("AIRFLOW_HOME") == str(self.home) or environ.get("RAYTPU_HOME") == str(
                        self.raytpu_home):
                    strays.append(process)
        described = []
        for process in strays:
            with contextlib.suppress(psutil.Error):
                described.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        kill_processes(strays, grace)
        return described

    # -- failure messages -----------------------------------------------------------------------

    def diagnostics(self, lines: int = 40) -> str:
        """The last lines of every component's log (every start), for a failure message."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- last {lines} lines of {log} ---\n{tail(log, lines)}")
        return "\n".join(parts)


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


EXPECTED_DAGS = {"tpu_cluster_lifecycle", "nightly_finetune", "nightly_embeddings", "tpu_model_serving",
                 "after_promotion", "raytpu_jobs", "raytpu_training", "raytpu_training_error", "raytpu_soak",
                 "etl_daily", "etl.daily", "raytpu_overlap"}


def local_connection(deployment: AirflowDeployment, conn_id: str = "raytpu_default") -> dict[str, str]:
    """The body the connection form sends for a ``raytpu`` connection to the local backend."""
    extra = {"backend": "local", "namespace": "default", "local_home": str(deployment.raytpu_home)}
    return {"connection_id": conn_id, "conn_type": "raytpu", "extra": json.dumps(extra)}


def local_backend(deployment: AirflowDeployment) -> LocalBackend:
    """The deployment's local backend, read from this process (to check what tasks left behind)."""
    return LocalBackend(ConnectionSettings.from_extra(
        "raytpu_default", {"backend": "local", "local_home": str(deployment.raytpu_home)}
    ))


#: A head and one emulated host, started one at a time beside other tiers' clusters: CI's soak cluster was not READY
#: within 240 s while two runs of an example started clusters of their own. 360 s leaves the module's first test
#: 240 s of pytest-timeout's 600.
CLUSTER_READY_SECONDS = 360.0


def wait_cluster_ready(api: AirflowApi, backend: LocalBackend, name: str, what: str) -> None:
    """Wait until the local cluster ``name`` (namespace ``default``) is READY; a timeout names its last status."""
    try:
        api.wait(what, lambda: backend.cluster_status(name, "default").phase is Phase.READY, CLUSTER_READY_SECONDS)
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}\n{name}'s last status: {backend.cluster_status(name, 'default')}") from None
