"""The control plane's processes: where the built binaries are, free ports, and one started
component (its argv, log file, health, SIGTERM-then-SIGKILL stop).

Children get ``PR_SET_PDEATHSIG=SIGKILL`` (Linux), so they die with the test process even if it
is killed hard; only PIDs started here are ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "controlplane" / "build_binaries.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kuberay-operator")


class ControlPlaneError(RuntimeError):
    """A component failed to start or the control plane is unusable."""


class BinariesNotBuilt(ControlPlaneError):
    """build_binaries.sh has not produced a complete set of binaries."""


def find_bin_dir() -> Path:
    """Locate the cached binaries (``RAYTPU_K8S_BIN_DIR`` overrides).

    Raises :class:`BinariesNotBuilt` with instructions if they are missing.
    """
    override = os.environ.get("RAYTPU_K8S_BIN_DIR")
    if override:
        bin_dir = Path(override)
    else:
        if shutil.which("go") is None:
            raise BinariesNotBuilt("`go` is not on PATH, so the binary cache key cannot be computed; "
                                   "set RAYTPU_K8S_BIN_DIR or install Go and run tests/controlplane/build_binaries.sh")
        proc = subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BinariesNotBuilt(
                "Kubernetes control-plane binaries are not built; run `bash tests/controlplane/build_binaries.sh` "
                f"(10-25 min cold on 2 cores, then cached). {proc.stderr.strip()}")
        bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise BinariesNotBuilt(f"missing binaries in {bin_dir}: {', '.join(missing)}")
    return bin_dir


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1."""
    socks, ports = [], []
    try:
        for _ in range(n):  # hold them all open so the n ports are distinct
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _child_setup() -> None:  # runs in the forked child before exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after: float | None = None  # seconds from spawn to healthy

    def spawn(self) -> None:
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, preexec_fn=_child_setup, close_fds=True)
        finally:
            log.close()
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            data = self.log_path.read_bytes()[-64_000:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(data.splitlines()[-lines:])

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(5)

