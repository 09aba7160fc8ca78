"""Pods whose containers really run: as processes on this machine, each pod in a network of its own.

The virtual kubelet (kubelet.py) hands a pod bound to a node labelled :data:`LABEL_HOST_PROCESSES`
to :class:`HostProcessPod`. Like a kubelet it runs the pod's init containers one after the other to
completion, then its first container; each runs its ``command`` + ``args`` with the container's
environment over what the local backend gives its Ray processes (``ray_process_env``: the
virtualenv's ``bin`` first on ``PATH``, so the image's ``ray`` is ours; no token authentication
unless the pod's own environment turns it on, as KubeRay's ``authOptions`` does). The environment is
resolved as a kubelet does: plain values with ``$(VAR)`` references expanded, ``fieldRef`` and
``secretKeyRef`` values, and before them what GKE's TPU device plugin adds to a container that was
allocated ``google.com/tpu`` chips (tests/controlplane/tpuenv.py). The container's own ``readinessProbe``
(an exec probe) decides when the pod is Ready.

With a :class:`~tests.controlplane.podnet.PodSandbox` (the normal case) every process runs inside the pod's
network namespace: the pod has its own IP, ``0.0.0.0`` and ``localhost`` are the pod's, and many
Ray pods (heads included) run side by side with KubeRay's fixed ports. Without one (no
CAP_NET_ADMIN) the pod shares this machine's address, so only one such pod runs per node.

What this machine's budget changes in a pod: a TPU host's raylet gets at most 1 CPU (``--num-cpus``,
which KubeRay takes from the container's CPU limit, a TPU machine type's vCPUs, is capped in the
container's command; a head keeps what KubeRay gives it), every raylet a 150 MiB object store,
Ray's files go to a directory of the pod's own (``RAY_TMPDIR``; a worker's ``ray start`` gets it as
``--temp-dir``, else it would share the head's), and JAX runs on the CPU.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.process import cluster_processes, kill_processes, ray_process_env
from tests.controlplane.podnet import PodSandbox
from tests.controlplane.tpuenv import container_tpu_env

LABEL_HOST_PROCESSES = "raytpu.test/host-processes"
MAX_CPUS = 1
OBJECT_STORE_BYTES = 150 * 1024 * 1024

# The Airflow / test environment that must not leak into the "container" (ray_process_env drops the rest).
_NOT_INHERITED = ("AIRFLOW_HOME", "PYTEST_CURRENT_TEST")
_FIELD_PATH = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_NUM_CPUS = re.compile(r"--num-cpus[= ]['\"]?([0-9.]+)['\"]?")
_RAY_START = re.compile(r"\bray start\b")


def host_address() -> str:
    """This machine's first non-loopback IPv4 address (the API server refuses to proxy to loopback)."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    raise RuntimeError("no non-loopback IPv4 address on this machine: host-process pods need one, "
                       "because the API server's service proxy refuses loopback endpoints")


@dataclass(frozen=True)
class NodeFacts:
    """What a kubelet knows about its node and a container needs: address, labels, TPU chips.

    :param ip: the node's InternalIP (``status.hostIP``).
    :param labels: the node's labels (the TPU device plugin reads accelerator and topology).
    :param tpu_chips: the node's ``google.com/tpu`` capacity.
    """

    ip: str
    labels: Mapping[str, str] = field(default_factory=dict)
    tpu_chips: int = 0


def _field_value(pod: Any, field_path: str, pod_ip: str, host_ip: str) -> str:
    """What a kubelet puts in an env var from ``valueFrom.fieldRef``."""
    simple = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
              "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name,
              "spec.serviceAccountName": pod.spec.service_account_name, "status.podIP": pod_ip,
              "status.hostIP": host_ip}
    if field_path in simple:
        return simple[field_path] or ""
    if match := _FIELD_PATH.fullmatch(field_path):
        return (getattr(pod.metadata, match.group(1)) or {}).get(match.group(2), "")
    raise ValueError(f"host-process pods do not resolve fieldRef {field_path!r}")


def expand(value: str, defined: Mapping[str, str]) -> str:
    """A kubelet's ``$(VAR)`` expansion: a variable defined earlier in the container is replaced,
    an unknown reference stays as written, ``$$`` is a literal ``$``."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return defined.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, value)


#: A Secret's data (decoded) by namespace and name, or ``None`` when it does not exist.
SecretReader = Callable[[str, str], Mapping[str, str] | None]


def container_env(pod: Any, container: Any, pod_ip: str, host_ip: str | None = None,
                  secrets: SecretReader | None = None) -> dict[str, str]:
    """The container's environment as a kubelet resolves it: values, fieldRefs and secretKeyRefs (KubeRay's
    ``RAY_AUTH_TOKEN`` of a cluster with token authentication)."""
    env: dict[str, str] = {}
    for var in container.env or []:
        source = var.value_from
        if var.value is not None:
            env[var.name] = expand(var.value, env)
        elif source is not None and source.field_ref is not None:
            env[var.name] = _field_value(pod, source.field_ref.field_path, pod_ip, host_ip or pod_ip)
        elif source is not None and source.secret_key_ref is not None and secrets is not None:
            ref = source.secret_key_ref
            data = secrets(pod.metadata.namespace, ref.name)
            if data is None or ref.key not in data:  # a kubelet says CreateContainerConfigError and retries
                raise LookupError(f"env {var.name!r}: key {ref.key!r} of Secret {pod.metadata.namespace}/{ref.name} "
                                  "does not exist")
            env[var.name] = data[ref.key]
        elif source is not None:
            raise ValueError(f"host-process pods do not resolve env {var.name!r} from {source}")
        else:
            env[var.name] = ""
    return env


def cap_cpus(argv: list[str]) -> list[str]:
    """``--num-cpus=N`` in a TPU host container's command, at most :data:`MAX_CPUS` (this machine's budget)."""
    def cap(match: re.Match[str]) -> str:
        return f"--num-cpus={min(float(match.group(1)), MAX_CPUS):g}"

    return [_NUM_CPUS.sub(cap, arg) for arg in argv]


def own_temp_dir(argv: list[str], temp_dir: Path) -> list[str]:
    """A worker's ``ray start`` given ``--temp-dir``: the pod's own directory, as its own filesystem would be.

    Without it a worker node takes the head's temp dir (Ray's ``Node._init_temp``), which on one machine is
    the same directory for every pod: Ray numbers the sockets of each raylet joining it, and two raylets
    starting at once pick the same number (measured: two recreated TPU hosts both bound ``plasma_store.3``).
    """
    def own(arg: str) -> str:
        if "--head" in arg or "--temp-dir" in arg:
            return arg
        return _RAY_START.sub(f"ray start --temp-dir={temp_dir}", arg)

    return [own(arg) for arg in argv]


class HostProcessPod:
    """One pod's containers, running as processes of this machine until :meth:`stop`.

    :param pod: the pod (kubernetes client model) as bound to its node.
    :param node: the node's address, labels and TPU chips.
    :param log_path: where the containers' stdout and stderr go.
    :param ray_tmp: the pod's own directory for Ray's files (short: Unix socket paths live under it).
    :param sandbox: the pod's network namespace; ``None``: the pod shares this machine's network.
    :param secrets: reads the Secrets its environment refers to.
    """

    def __init__(self, pod: Any, node: NodeFacts, log_path: Path, ray_tmp: Path,
                 sandbox: PodSandbox | None = None, secrets: SecretReader | None = None) -> None:
        self.key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        self.uid = pod.metadata.uid
        self.sandbox = sandbox
        self.pod_ip = sandbox.ip if sandbox else node.ip
        self.log_path = log_path
        self._pod = pod
        self._node = node
        self._ray_tmp = ray_tmp
        self._secrets = secrets
        self._process: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._lock = threading.Lock()  # a restart never starts a container after stop() took the pod's processes
        self.restarts = 0
        container = pod.spec.containers[0]
        self._probe = container.readiness_probe
        self._env = self._environment(container)
        self.started = time.monotonic()
        self._spawned_at = time.time()  # wall time: compared with the mtimes of Ray's port files

    def _environment(self, container: Any) -> dict[str, str]:
        # The marker finds every process of this pod at stop(), daemons included.
        env = {k: v for k, v in ray_process_env(self.uid).items() if k not in _NOT_INHERITED}
        limits = (container.resources.limits if container.resources else None) or {}
        env.update(container_tpu_env(self._node.labels, self._node.tpu_chips, limits))
        env.update(container_env(self._pod, container, self.pod_ip, self._node.ip, self._secrets))
        self._ray_tmp.mkdir(parents=True, exist_ok=True)
        env.update({
            "RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES": str(OBJECT_STORE_BYTES),
            "RAY_TMPDIR": str(self._ray_tmp),
            "JAX_PLATFORMS": "cpu",
        })
        return env

    def _argv(self, container: Any) -> list[str]:
        argv = [*(container.command or []), *(container.args or [])]
        limits = (container.resources.limits if container.resources else None) or {}
        if str(limits.get("google.com/tpu", "0")) not in ("", "0"):
            argv = cap_cpus(argv)
        argv = own_temp_dir(argv, self._ray_tmp)
        return self.sandbox.command(argv) if self.sandbox else argv

    def _spawn(self, container: Any, env: dict[str, str]) -> subprocess.Popen[bytes]:
        self._spawned_at = time.time()
        with open(self.log_path, "ab") as log:
            log.write(f"=== container {container.name} (pod IP {self.pod_ip})\n".encode())
            log.flush()
            return subprocess.Popen(self._argv(container), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=str(self.log_path.parent))

    def run(self, stopping: Any, init_timeout: float = 600.0, start_slot: Callable[[], bool] | None = None) -> bool:
        """Run the init containers to completion, one after the other, then start the first container.

        :param stopping: an Event; set, nothing more is started.
        :param init_timeout: seconds all init containers may take together.
        :param start_slot: waits until the first container may start (``False``: it may not); taken only once the
            init containers are done (a worker's waits for the head, which may be holding a slot).
        :return: whether the first container was started (``False`` after ``start_slot`` gave a slot: the pod was
            stopped meanwhile, and the caller gives the slot back).
        """
        deadline = time.monotonic() + init_timeout
        for container in self._pod.spec.init_containers or []:
            env = {**self._env, **container_env(self._pod, container, self.pod_ip, self._node.ip, self._secrets)}
            process = self._spawn(container, env)
            self._process = process
            while process.poll() is None:
                if stopping.is_set() or self._stopped or time.monotonic() > deadline:
                    return False
                stopping.wait(0.5)
            if process.returncode != 0:
                return False  # a kubelet would restart it; KubeRay's wait-gcs-ready never exits non-zero
        if stopping.is_set() or self._stopped or (start_slot is not None and not start_slot()):
            return False
        with self._lock:  # stop() may have come while waiting for the slot
            if self._stopped:
                return False
            self._process = self._spawn(self._pod.spec.containers[0], self._env)
            return True

    @property
    def main_pid(self) -> int | None:
        """The pid of the running container's first process (``ray start --block``)."""
        return self._process.pid if self._process is not None else None

    def exited(self) -> int | None:
        return self._process.poll() if self._process is not None else None

    def ready(self) -> bool:
        """The container's readiness probe (exec, in the pod's network) passes; no probe: it is alive."""
        if self._process is None or self.exited() is not None:
            return False
        if self._probe is None or self._probe._exec is None:
            return True
        timeout = (self._probe.timeout_seconds or 1) + 5
        command = list(self._probe._exec.command)
        try:
            return subprocess.run(self.sandbox.command(command) if self.sandbox else command, env=self._env,
                                  capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def agents_started(self) -> bool:
        """Whether the container's Ray node got past its agents' start since the container started: its dashboard
        agent wrote its HTTP port file, the last one the raylet waits 15 s for (Ray issue 65983)."""
        for file in [*self._ray_tmp.glob("session_2*/dashboard_agent_listen_port_*"),
                     *self._ray_tmp.glob("ray/session_2*/dashboard_agent_listen_port_*")]:
            with contextlib.suppress(OSError):  # removed meanwhile, with a stopped pod's files
                if file.stat().st_mtime >= self._spawned_at:
                    return True
        return False

    def wait_ready(self, timeout: float, stopping: Any) -> bool:
        """Probe every ``periodSeconds`` (at most 1 s here) until ready, exited, or ``stopping`` is set."""
        period = min(float(getattr(self._probe, "period_seconds", None) or 1), 1.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopping.is_set():
            if self.ready():
                return True
            if self.exited() is not None:
                return False
            stopping.wait(period)
        return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def restart(self) -> bool:
        """Start the first container again after it exited, as a kubelet does (restartPolicy Always): what the
        container left running is stopped first, as its cgroup would be. ``False`` once the pod is being stopped."""
        with self._lock:
            if self._stopped:
                return False
            self._kill_own_processes(grace=5.0)
            self._process = self._spawn(self._pod.spec.containers[0], self._env)
            self.restarts += 1
            return True

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process of the pod (its session, its marker, its network namespace), SIGKILL what is left."""
        with self._lock:
            self._stopped = True
            self._kill_own_processes(grace)
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)

    def _kill_own_processes(self, grace: float) -> None:
        import psutil

        session = self._process.pid if self._process is not None else None
        processes, _ = cluster_processes(self.uid, session, session_is_ours=True)
        known = {p.pid for p in processes}
        for pid in self.sandbox.pids() if self.sandbox else []:
            if pid not in known:
                with contextlib.suppress(psutil.Error):
                    processes.append(psutil.Process(pid))
        kill_processes(processes, grace)
