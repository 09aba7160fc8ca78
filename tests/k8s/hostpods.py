"""Pods whose container really runs: as processes on this machine, like ``hostNetwork`` pods.

The virtual kubelet (kubelet.py) hands a pod bound to a node labelled
:data:`LABEL_HOST_PROCESSES` to :class:`HostProcessPod`: the pod's first container's
``command`` + ``args`` run under bash with the container's environment (plain values and
the ``fieldRef`` ones a kubelet resolves) over what the local backend gives its Ray processes
(``ray_process_env``: the virtualenv's ``bin`` first on ``PATH``, so the image's ``ray`` is
ours; no token authentication), and the container's own ``readinessProbe`` (an exec probe) decides
when the pod is Ready. The pod's IP is the node's InternalIP, this machine's non-loopback
address, so the API server's service proxy reaches what the container serves.

For a KubeRay head pod that is a real Ray head with its dashboard on 8265: job submission
through ``/api/v1/namespaces/<ns>/services/<head-svc>:dashboard/proxy`` reaches a real Ray.
The ports are the container's own, fixed, so one such pod runs per node at a time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from airflow_provider_raytpu.backends.local.process import cluster_processes, kill_processes, ray_process_env

LABEL_HOST_PROCESSES = "raytpu.test/host-processes"

# The Airflow / test environment that must not leak into the "container" (ray_process_env drops the rest).
_NOT_INHERITED = ("AIRFLOW_HOME", "PYTEST_CURRENT_TEST")
_FIELD_PATH = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def host_address() -> str:
    """This machine's first non-loopback IPv4 address (the API server refuses to proxy to loopback)."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    raise RuntimeError("no non-loopback IPv4 address on this machine: host-process pods need one, "
                       "because the API server's service proxy refuses loopback endpoints")


def _field_value(pod: Any, field_path: str, pod_ip: str) -> str:
    """What a kubelet puts in an env var from ``valueFrom.fieldRef``."""
    simple = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
              "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name,
              "spec.serviceAccountName": pod.spec.service_account_name, "status.podIP": pod_ip,
              "status.hostIP": pod_ip}
    if field_path in simple:
        return simple[field_path] or ""
    if match := _FIELD_PATH.fullmatch(field_path):
        return (getattr(pod.metadata, match.group(1)) or {}).get(match.group(2), "")
    raise ValueError(f"host-process pods do not resolve fieldRef {field_path!r}")


def container_env(pod: Any, container: Any, pod_ip: str) -> dict[str, str]:
    """The container's environment as a kubelet resolves it (values and fieldRefs; not secrets)."""
    env: dict[str, str] = {}
    for var in container.env or []:
        if var.value is not None:
            env[var.name] = var.value
        elif var.value_from is not None and var.value_from.field_ref is not None:
            env[var.name] = _field_value(pod, var.value_from.field_ref.field_path, pod_ip)
        elif var.value_from is not None:
            raise ValueError(f"host-process pods do not resolve env {var.name!r} from {var.value_from}")
        else:
            env[var.name] = ""
    return env


class HostProcessPod:
    """One pod's first container, running as processes of this machine until :meth:`stop`.

    :param pod: the pod (kubernetes client model) as bound to its node.
    :param pod_ip: the node's InternalIP (the pod shares the node's network).
    :param log_path: where the container's stdout and stderr go.
    """

    def __init__(self, pod: Any, pod_ip: str, log_path: Path) -> None:
        self.key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        self.uid = pod.metadata.uid
        self.pod_ip = pod_ip
        self.log_path = log_path
        container = pod.spec.containers[0]
        self._probe = container.readiness_probe
        # The marker finds every process of this pod at stop(), daemons included.
        env = {k: v for k, v in ray_process_env(self.uid).items() if k not in _NOT_INHERITED}
        env.update(container_env(pod, container, pod_ip))
        env.update({
            "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.01",  # the container's 8Gi limit is not ours to take
            "JAX_PLATFORMS": "cpu",
        })
        self._env = env
        argv = [*(container.command or []), *(container.args or [])]
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             cwd=str(log_path.parent))
        self.started = time.monotonic()

    def exited(self) -> int | None:
        return self._process.poll()

    def ready(self) -> bool:
        """The container's readiness probe (exec) passes; no probe: the main process is alive."""
        if self.exited() is not None:
            return False
        if self._probe is None or self._probe._exec is None:
            return True
        timeout = (self._probe.timeout_seconds or 1) + 5
        try:
            return subprocess.run(self._probe._exec.command, env=self._env, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
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

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process of the pod (its session and its marker), SIGKILL what is left."""
        processes, _ = cluster_processes(self.uid, self._process.pid, session_is_ours=True)
        kill_processes(processes, grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=5)
