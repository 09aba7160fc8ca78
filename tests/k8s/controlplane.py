"""A real, local Kubernetes control plane for integration tests.

``ControlPlane`` starts, on 127.0.0.1 with free ports and in a temporary
directory, the real binaries built by ``build_binaries.sh``:

1. etcd,
2. kube-apiserver (generated CA, serving cert, service-account keys, static
   bearer tokens, ``--authorization-mode=Node,RBAC``),
3. the KubeRay CRDs from the ray-operator module (applied, waited Established),
4. kube-scheduler,
5. the KubeRay operator (``--feature-gates=RayMultiHostIndexing=true``),
6. kube-controller-manager (garbage collection, EndpointSlices, service
   accounts, node lifecycle, ...),

plus a *virtual kubelet* (:class:`VirtualKubelet`, Python, official
``kubernetes`` client, watches in a background thread) that makes the fake
GKE nodes created by :meth:`ControlPlane.add_node_pool` look alive: it renews
their Leases, reports pods bound to them Running and Ready, finishes pods that
are being deleted, and fails + deletes the pods of a node that is deleted
(what GKE does on a preemption).

Usage::

    with ControlPlane.start() as cp:
        cp.add_node_pool("v6e-4x4", tpu="tpu-v6e-slice", topology="4x4", num_nodes=8)
        core = kubernetes.client.CoreV1Api(cp.api_client())

or the session fixture :func:`k8s_control_plane` (import it into a conftest).

Each component logs to ``<tmpdir>/logs/<name>.log``; a component that fails to
start raises :class:`ControlPlaneError` with the tail of its log. Everything
is stopped by PID at exit (SIGTERM, then SIGKILL after a timeout); the
children also get PR_SET_PDEATHSIG so they die with the test process even if it
is killed hard.
"""

from __future__ import annotations

import atexit
import base64
import collections
import concurrent.futures
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.k8s.hostpods import LABEL_HOST_PROCESSES, HostProcessPod, host_address

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build_binaries.sh"

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kuberay-operator")
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

# GKE node labels and taints.
LABEL_TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
LABEL_TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
LABEL_NODEPOOL = "cloud.google.com/gke-nodepool"
LABEL_SPOT = "cloud.google.com/gke-spot"
TPU_RESOURCE = "google.com/tpu"
# Marks the nodes this harness owns (the virtual kubelet serves only these).
LABEL_VIRTUAL = "raytpu.test/virtual-kubelet"

# TPU accelerator label -> GKE machine type for 4-chip hosts (for realism only).
_TPU_MACHINE_TYPES = {
    "tpu-v6e-slice": "ct6e-standard-4t",
    "tpu-v5-lite-podslice": "ct5lp-hightpu-4t",
    "tpu-v5p-slice": "ct5p-hightpu-4t",
    "tpu-v4-podslice": "ct4p-hightpu-4t",
}


class ControlPlaneError(RuntimeError):
    """A component failed to start or the control plane is unusable."""


class BinariesNotBuilt(ControlPlaneError):
    """build_binaries.sh has not produced a complete set of binaries."""


# --------------------------------------------------------------------------- #
# binaries, ports, processes
# --------------------------------------------------------------------------- #


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
                                   "set RAYTPU_K8S_BIN_DIR or install Go and run tests/k8s/build_binaries.sh")
        proc = subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BinariesNotBuilt(
                "Kubernetes control-plane binaries are not built; run `bash tests/k8s/build_binaries.sh` "
                f"(10-25 min cold on 2 cores, then cached). {proc.stderr.strip()}")
        bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise BinariesNotBuilt(f"missing binaries in {bin_dir}: {', '.join(missing)}")
    return bin_dir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
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


# --------------------------------------------------------------------------- #
# certificates
# --------------------------------------------------------------------------- #


def _write_pki(d: Path) -> dict[str, Path]:
    """CA, kube-apiserver serving cert, service-account RSA key pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=7)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raytpu-test-ca")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    srv_key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                      "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name).public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    paths = {
        "ca_crt": d / "ca.crt", "ca_key": d / "ca.key",
        "apiserver_crt": d / "apiserver.crt", "apiserver_key": d / "apiserver.key",
        "sa_key": d / "sa.key", "sa_pub": d / "sa.pub",
    }
    paths["ca_crt"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["ca_key"].write_bytes(pem_key(ca_key))
    paths["apiserver_crt"].write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    paths["apiserver_key"].write_bytes(pem_key(srv_key))
    paths["sa_key"].write_bytes(pem_key(sa_key))
    paths["sa_pub"].write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for k in ("ca_key", "apiserver_key", "sa_key"):
        paths[k].chmod(0o600)
    return paths


# --------------------------------------------------------------------------- #
# the control plane
# --------------------------------------------------------------------------- #


@dataclass
class _Identity:
    user: str
    groups: tuple[str, ...]
    token: str = field(default_factory=lambda: secrets.token_hex(24))


class ControlPlane:
    """etcd + kube-apiserver + scheduler + controller-manager + KubeRay operator.

    Attributes: ``server`` (https URL), ``admin_token``, ``ca_path``,
    ``kubeconfig_path`` (admin), ``workdir`` (temp dir), ``logs_dir``,
    ``crd_dir``, ``timings`` (seconds per startup step), ``components``.
    """

    def __init__(self, *, bin_dir: Path | None = None, workdir: Path | None = None,
                 crd_dir: Path | None = None, keep_workdir: bool | None = None,
                 operator_args: list[str] | None = None,
                 kubelet: bool = True) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir else find_bin_dir()
        self.crd_dir = Path(crd_dir) if crd_dir else self.bin_dir.parent / "crds"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="raytpu-k8s-"))
        if keep_workdir is None:
            keep_workdir = os.environ.get("RAYTPU_K8S_KEEP", "") not in ("", "0")
        self.keep_workdir = keep_workdir
        self.logs_dir = self.workdir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.operator_args = list(operator_args or [])
        self._want_kubelet = kubelet
        self.components: dict[str, Component] = {}
        self.timings: dict[str, float] = {}
        self.kubelet: VirtualKubelet | None = None
        self._stopped = False
        self._node_seq = 0
        self._pool_sizes: dict[str, int] = {}
        self._lock = threading.Lock()

        self.identities = {
            "admin": _Identity("raytpu-admin", ("system:masters",)),
            "scheduler": _Identity("system:kube-scheduler", ()),
            # --use-service-account-credentials=false: the controller manager
            # runs every controller under its own identity, so it needs more
            # than its bootstrap role.
            "controller-manager": _Identity("system:kube-controller-manager", ("system:masters",)),
            # The operator runs outside the cluster; give it full rights
            # rather than installing KubeRay's RBAC.
            "kuberay-operator": _Identity("kuberay-operator", ("system:masters",)),
        }
        self.admin_token = self.identities["admin"].token
        (self.etcd_port, self.etcd_peer_port, self.apiserver_port, self.scheduler_port,
         self.kcm_port, self.operator_metrics_port, self.operator_probe_port) = _free_ports(7)
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.pki: dict[str, Path] = {}
        self.ca_path: Path = self.workdir / "pki" / "ca.crt"
        self.kubeconfig_path: Path = self.workdir / "admin.kubeconfig"

    # ------------------------------------------------------------------ start
    @classmethod
    @contextlib.contextmanager
    def start(cls, **kwargs: Any) -> Iterator["ControlPlane"]:
        """Context manager: start everything, yield the control plane, stop."""
        cp = cls(**kwargs)
        try:
            cp.up()
            yield cp
        finally:
            cp.stop()

    def up(self, timeout: float = 120.0) -> "ControlPlane":
        """Start everything (stopping what was started if a step fails)."""
        atexit.register(self.stop)
        try:
            return self._up(timeout)
        except BaseException:
            self.keep_workdir = True  # keep the component logs for a post-mortem
            self.stop()
            raise

    def _up(self, timeout: float) -> "ControlPlane":
        t0 = time.monotonic()
        deadline = t0 + timeout

        def step(name: str, fn: Callable[[], Any]) -> Any:
            s = time.monotonic()
            out = fn()
            self.timings[name] = round(time.monotonic() - s, 2)
            return out

        self.pki = step("pki", lambda: _write_pki(self.workdir / "pki"))
        self.ca_path = self.pki["ca_crt"]
        self._write_auth_files()

        step("etcd", lambda: self._start_and_wait(self._etcd(), self._etcd_healthy, deadline))
        step("kube-apiserver", lambda: self._start_and_wait(self._apiserver(), self._apiserver_ready, deadline))
        # The scheduler does not need the CRDs: it comes up while they are
        # being established. The controller manager starts after them: its
        # garbage collector would otherwise learn about ray.io kinds only at
        # its next discovery resync (30 s), and deleting a RayCluster would
        # leave its pods for that long.
        sched = self._scheduler()
        sched.spawn()
        step("crds", lambda: self._apply_crds(deadline))
        kcm = self._controller_manager()
        kcm.spawn()
        step("kuberay-operator", lambda: self._start_and_wait(self._operator(), self._operator_ready, deadline))
        step("kube-scheduler", lambda: self._wait(sched, lambda: self._https_healthz(self.scheduler_port), deadline))
        step("kube-controller-manager", lambda: self._wait(kcm, lambda: self._https_healthz(self.kcm_port), deadline))
        step("default-serviceaccount", lambda: self._wait_default_service_account(deadline))
        if self._want_kubelet:
            self.kubelet = VirtualKubelet(self)
            step("virtual-kubelet", self.kubelet.start)
        self.timings["total"] = round(time.monotonic() - t0, 2)
        (self.workdir / "timings.json").write_text(json.dumps(self.timings, indent=1))
        return self

    # --------------------------------------------------------------- stop
    def stop(self) -> None:
        """Stop the virtual kubelet and every process (reverse start order)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self.kubelet is not None:
            self.kubelet.stop(timeout=5)
        # Clients first (in parallel), then the API server, then etcd.
        tiers = [["kuberay-operator", "kube-controller-manager", "kube-scheduler"], ["kube-apiserver"], ["etcd"]]
        for tier in tiers:
            comps = [self.components[n] for n in tier if n in self.components]
            for comp in comps:
                comp.terminate()
            for comp in comps:
                comp.stop()
        for comp in self.components.values():  # anything not in a tier
            comp.stop()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def pids(self) -> dict[str, int]:
        return {n: c.pid for n, c in self.components.items() if c.pid is not None}

    # ------------------------------------------------------------ auth files
    def _write_auth_files(self) -> None:
        lines = []
        for ident in self.identities.values():
            groups = ",".join(ident.groups)
            lines.append(f'{ident.token},{ident.user},{ident.user},"{groups}"' if groups
                         else f"{ident.token},{ident.user},{ident.user}")
        self.token_file = self.workdir / "tokens.csv"
        self.token_file.write_text("\n".join(lines) + "\n")
        self.token_file.chmod(0o600)
        for name in self.identities:
            path = self.workdir / f"{name}.kubeconfig"
            path.write_text(json.dumps(self.kubeconfig_dict(token=self.identities[name].token, user=name), indent=1))
            path.chmod(0o600)
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"

    def kubeconfig_dict(self, *, token: str | None = None, user: str = "admin",
                        namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig as a dict (CA embedded), e.g. for an Airflow
        cncf-kubernetes connection's ``kube_config`` extra. Admin by default."""
        ca_data = base64.b64encode(self.pki["ca_crt"].read_bytes()).decode() if self.pki else None
        cluster: dict[str, Any] = {"server": self.server}
        if ca_data:
            cluster["certificate-authority-data"] = ca_data
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "raytpu-test", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "raytpu-test", "context": {"cluster": "raytpu-test", "user": user,
                                                              "namespace": namespace}}],
            "current-context": "raytpu-test",
            "preferences": {},
        }

    def api_client(self, token: str | None = None):
        """A new ``kubernetes.client.ApiClient`` (admin unless ``token``)."""
        from kubernetes import config

        return config.new_client_from_config_dict(self.kubeconfig_dict(token=token))

    # --------------------------------------------------------------- components
    def _component(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        comp = Component(name, argv, self.logs_dir / f"{name}.log", env)
        self.components[name] = comp
        return comp

    def _etcd(self) -> Component:
        c, p = self.etcd_port, self.etcd_peer_port
        return self._component("etcd", [
            str(self.bin_dir / "etcd"),
            "--name=raytpu-test",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{c}",
            f"--advertise-client-urls=http://127.0.0.1:{c}",
            f"--listen-peer-urls=http://127.0.0.1:{p}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{p}",
            f"--initial-cluster=raytpu-test=http://127.0.0.1:{p}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync",  # test data: durability not needed, much faster
            "--log-level=warn",
        ])

    def _apiserver(self) -> Component:
        pki = self.pki
        return self._component("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={pki['apiserver_crt']}",
            f"--tls-private-key-file={pki['apiserver_key']}",
            f"--client-ca-file={pki['ca_crt']}",
            f"--token-auth-file={self.token_file}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki['sa_pub']}",
            f"--service-account-signing-key-file={pki['sa_key']}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            # 127.0.0.1 may not be an endpoint of the `kubernetes` service.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            "--v=1",
        ])

    def _scheduler(self) -> Component:
        kc = str(self.workdir / "scheduler.kubeconfig")
        return self._component("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.scheduler_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            "--profiling=false",
            "--v=1",
        ])

    def _controller_manager(self) -> Component:
        kc = str(self.workdir / "controller-manager.kubeconfig")
        pki = self.pki
        return self._component("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.kcm_port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            # Everything on by default (1.37 has no cloud controllers left in
            # KCM), minus node IPAM: the nodes come with their podCIDR.
            "--controllers=*,-node-ipam-controller",
            f"--service-account-private-key-file={pki['sa_key']}",
            f"--root-ca-file={pki['ca_crt']}",
            f"--cluster-signing-cert-file={pki['ca_crt']}",
            f"--cluster-signing-key-file={pki['ca_key']}",
            "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--profiling=false",
            "--v=1",
        ])

    def _operator(self) -> Component:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.workdir / "kuberay-operator.kubeconfig")
        return self._component("kuberay-operator", [
            str(self.bin_dir / "kuberay-operator"),
            "--feature-gates=RayMultiHostIndexing=true",
            # Dashboards and Serve proxies through the API server (services/proxy, pods/proxy): the
            # operator runs outside any pod network, and the API server can reach host-process pods.
            "--use-kubernetes-proxy",
            "--enable-leader-election=false",
            f"--metrics-addr=127.0.0.1:{self.operator_metrics_port}",
            f"--health-probe-bind-address=127.0.0.1:{self.operator_probe_port}",
            "--log-stdout-encoder=console",
            *self.operator_args,
        ], env=env)

    # --------------------------------------------------------------- waiting
    def _start_and_wait(self, comp: Component, probe: Callable[[], bool], deadline: float) -> None:
        comp.spawn()
        self._wait(comp, probe, deadline)

    def _wait(self, comp: Component, probe: Callable[[], bool], deadline: float) -> None:
        delay = 0.05
        while True:
            if not comp.alive():
                rc = comp.proc.returncode if comp.proc else None
                raise ControlPlaneError(
                    f"{comp.name} exited (rc={rc}) during startup; log {comp.log_path}:\n{comp.log_tail()}")
            with contextlib.suppress(Exception):
                if probe():
                    comp.ready_after = round(time.monotonic() - comp.started_at, 2)
                    return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{comp.name} not healthy in time; log {comp.log_path}:\n{comp.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _ssl_ctx(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki["ca_crt"]))

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str = "application/json", timeout: float = 10.0) -> tuple[int, bytes]:
        """Raw admin HTTP request to the API server (no client model parsing)."""
        req = urllib.request.Request(self.server + path, data=body, method=method, headers={
            "Authorization": f"Bearer {self.admin_token}", "Content-Type": content_type,
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl_ctx(), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as r:
            return r.status == 200 and b'"true"' in r.read()

    def _apiserver_ready(self) -> bool:
        status, _ = self.request("GET", "/readyz", timeout=3)
        return status == 200

    def _https_healthz(self, port: int) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # self-signed serving certs of the component
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2) as r:
            return r.status == 200

    def _operator_ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.operator_probe_port}/readyz", timeout=2) as r:
            return r.status == 200

    def _apply_crds(self, deadline: float) -> None:
        files = sorted(self.crd_dir.glob("ray.io_*.yaml"))
        if not files:
            raise ControlPlaneError(f"no KubeRay CRDs in {self.crd_dir} (run build_binaries.sh)")
        def create(f: Path) -> str:
            # The API server takes YAML directly: no slow client-side parsing
            # of the ~1 MB schemas.
            status, body = self.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                        f.read_bytes(), content_type="application/yaml", timeout=60)
            if status not in (200, 201, 409):
                raise ControlPlaneError(f"creating CRD {f.name}: HTTP {status}: {body[:2000]!r}")
            return f"{f.name[len('ray.io_'):-len('.yaml')]}.ray.io"

        # All at once: the API server then rebuilds its OpenAPI documents
        # (the costly part, ~1 MB schemas each) fewer times.
        with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
            names = list(pool.map(create, files))
        self.crd_names = names
        # Cheap wait first: a CRD's resource shows up in discovery only once
        # it is Established. Then confirm on each (~1 MB) object once.
        plurals = {n.split(".", 1)[0] for n in names}
        while True:
            status, body = self.request("GET", "/apis/ray.io/v1")
            if status == 200 and plurals <= {r["name"] for r in json.loads(body).get("resources", [])}:
                break
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"ray.io/v1 resources {sorted(plurals)} not served in time")
            time.sleep(0.1)
        for name in names:
            while True:
                status, body = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                if status == 200:
                    conds = (json.loads(body).get("status") or {}).get("conditions") or []
                    if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                        break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} not Established in time")
                time.sleep(0.1)

    def _wait_default_service_account(self, deadline: float) -> None:
        # Pods cannot be created before the serviceaccount controller made
        # `default` in the namespace; tests should not race it.
        while True:
            status, _ = self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            if status == 200:
                return
            kcm = self.components["kube-controller-manager"]
            if not kcm.alive() or time.monotonic() > deadline:
                raise ControlPlaneError(f"no default ServiceAccount; kube-controller-manager log:\n{kcm.log_tail()}")
            time.sleep(0.1)

    # --------------------------------------------------------- service accounts
    def token_for(self, serviceaccount: str, namespace: str = "default", *, create: bool = True,
                  expiration_seconds: int = 3600, audiences: list[str] | None = None,
                  cluster_role: str | None = None) -> str:
        """A bearer token of ServiceAccount ``namespace/serviceaccount`` (TokenRequest API).

        ``create`` makes the ServiceAccount if missing; ``cluster_role`` (e.g.
        "cluster-admin", "edit", "view") binds it cluster-wide.
        """
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            if create:
                try:
                    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
                        metadata=client.V1ObjectMeta(name=serviceaccount)))
                except ApiException as e:
                    if e.status != 409:
                        raise
            if cluster_role:
                rbac = client.RbacAuthorizationV1Api(api)
                binding = client.V1ClusterRoleBinding(
                    metadata=client.V1ObjectMeta(name=f"{namespace}-{serviceaccount}-{cluster_role}"),
                    role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                                              name=cluster_role),
                    subjects=[client.RbacV1Subject(kind="ServiceAccount", name=serviceaccount,
                                                   namespace=namespace)])
                try:
                    rbac.create_cluster_role_binding(binding)
                except ApiException as e:
                    if e.status != 409:
                        raise
            tr = core.create_namespaced_service_account_token(serviceaccount, namespace, client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=audiences or [], expiration_seconds=expiration_seconds)))
            return tr.status.token

    def create_namespace(self, name: str, timeout: float = 30.0) -> str:
        """Create a namespace and wait for its ``default`` ServiceAccount
        (pods are rejected until the serviceaccount controller made it)."""
        body = json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}).encode()
        status, out = self.request("POST", "/api/v1/namespaces", body)
        if status not in (201, 409):
            raise ControlPlaneError(f"creating namespace {name}: HTTP {status}: {out[:500]!r}")
        deadline = time.monotonic() + timeout
        while self.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] != 200:
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"namespace {name}: no default ServiceAccount after {timeout}s")
            time.sleep(0.1)
        return name

    # --------------------------------------------------------------- nodes
    def add_node_pool(self, name: str, *, cpu_nodes: int | None = None, tpu: str | None = None,
                      topology: str | None = None, num_nodes: int | None = None,
                      chips_per_node: int = 4, spot: bool = False, cpu: str = "8",
                      memory: str = "32Gi", pods: str = "110", labels: dict[str, str] | None = None,
                      zone: str = "us-central2-b", wait_ready: bool = True,
                      host_processes: bool = False, timeout: float = 30.0) -> list[str]:
        """Create Nodes that look like a GKE node pool; return their names.

        CPU pool: ``add_node_pool("cpu", cpu_nodes=1)``. TPU pool:
        ``add_node_pool("v6e", tpu="tpu-v6e-slice", topology="4x4", num_nodes=8)``
        (``num_nodes`` defaults to one slice: chips in topology / chips_per_node).
        Calling it again with the same ``name`` adds nodes to that pool
        (``gke-<name>-<index>``), e.g. to replace a preempted node.
        With ``wait_ready`` waits until the node lifecycle controller has
        removed the ``node.kubernetes.io/not-ready`` taint. With ``host_processes``
        (one CPU node) the node's InternalIP is this machine's address and its pods'
        containers really run, as processes here (tests/k8s/hostpods.py).
        """
        from kubernetes import client

        if (cpu_nodes is None) == (tpu is None):
            raise ValueError("give exactly one of cpu_nodes= or tpu=")
        if tpu is not None:
            if not topology:
                raise ValueError("a TPU node pool needs topology=, e.g. '4x4'")
            if num_nodes is None:
                chips = 1
                for dim in topology.split("x"):
                    chips *= int(dim)
                num_nodes = max(1, chips // chips_per_node)
        else:
            num_nodes = cpu_nodes
        assert num_nodes is not None
        if host_processes and (tpu is not None or num_nodes != 1):
            raise ValueError("host_processes= is for one CPU node: its pods' ports are this machine's")

        base_labels = {
            LABEL_NODEPOOL: name,
            LABEL_VIRTUAL: "true",
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "topology.kubernetes.io/zone": zone,
            "topology.kubernetes.io/region": zone.rsplit("-", 1)[0],
            **(labels or {}),
        }
        taints = []
        capacity = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "100Gi"}
        if tpu is not None:
            base_labels[LABEL_TPU_ACCELERATOR] = tpu
            base_labels[LABEL_TPU_TOPOLOGY] = topology
            base_labels["node.kubernetes.io/instance-type"] = _TPU_MACHINE_TYPES.get(tpu, "ct-standard-4t")
            capacity[TPU_RESOURCE] = str(chips_per_node)
            taints.append(client.V1Taint(key=TPU_RESOURCE, value="present", effect="NoSchedule"))
        else:
            base_labels["node.kubernetes.io/instance-type"] = "e2-standard-8"
        if host_processes:
            base_labels[LABEL_HOST_PROCESSES] = "true"
        if spot:
            base_labels[LABEL_SPOT] = "true"
            taints.append(client.V1Taint(key=LABEL_SPOT, value="true", effect="NoSchedule"))

        names = []
        now = dt.datetime.now(dt.timezone.utc)
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            for i in range(num_nodes):
                with self._lock:
                    self._node_seq += 1
                    seq = self._node_seq
                    index = self._pool_sizes.get(name, 0)  # adding to a pool again scales it up
                    self._pool_sizes[name] = index + 1
                node_name = f"gke-{name}-{index}"
                node_ip = host_address() if host_processes else f"10.128.{seq // 250}.{seq % 250 + 2}"
                node = client.V1Node(
                    metadata=client.V1ObjectMeta(name=node_name,
                                                 labels={**base_labels, "kubernetes.io/hostname": node_name}),
                    spec=client.V1NodeSpec(taints=taints or None, pod_cidr=f"10.{64 + seq // 256}.{seq % 256}.0/24",
                                           pod_cidrs=[f"10.{64 + seq // 256}.{seq % 256}.0/24"],
                                           provider_id=f"gce://raytpu-test/{zone}/{node_name}"),
                    status=client.V1NodeStatus(
                        capacity=capacity, allocatable=capacity,
                        addresses=[client.V1NodeAddress(type="InternalIP", address=node_ip),
                                   client.V1NodeAddress(type="Hostname", address=node_name)],
                        conditions=[client.V1NodeCondition(
                            type="Ready", status="True", reason="KubeletReady",
                            message="virtual kubelet is posting ready status",
                            last_heartbeat_time=now, last_transition_time=now)],
                        node_info=client.V1NodeSystemInfo(
                            architecture="amd64", boot_id=str(uuid.uuid4()),
                            container_runtime_version="containerd://2.0.0",
                            kernel_version="6.6.0", kube_proxy_version="",
                            kubelet_version="v1.37.2", machine_id=uuid.uuid4().hex,
                            operating_system="linux", os_image="Container-Optimized OS",
                            system_uuid=str(uuid.uuid4())),
                    ),
                )
                core.create_node(node)  # the virtual kubelet sees it and takes its Lease
                names.append(node_name)
            if wait_ready:
                self._wait_nodes_schedulable(core, names, timeout)
        return names

    def _wait_nodes_schedulable(self, core, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending:
            for n in list(pending):
                node = core.read_node(n)
                keys = {t.key for t in (node.spec.taints or [])}
                if "node.kubernetes.io/not-ready" not in keys and "node.kubernetes.io/unreachable" not in keys:
                    pending.discard(n)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"nodes still tainted not-ready after {timeout}s: {sorted(pending)}; "
                                        f"kube-controller-manager log:\n"
                                        f"{self.components['kube-controller-manager'].log_tail(30)}")
            time.sleep(0.2)

    def delete_node_pool(self, name: str) -> list[str]:
        """Delete every Node of pool ``name``; return their names."""
        from kubernetes import client

        with self.api_client() as api:
            nodes = client.CoreV1Api(api).list_node(label_selector=f"{LABEL_NODEPOOL}={name}").items
        for n in nodes:
            self.delete_node(n.metadata.name)
        return [n.metadata.name for n in nodes]

    def delete_node(self, name: str) -> None:
        """Delete a Node (like a GKE preemption / node-pool scale-down); the
        virtual kubelet fails and deletes its pods."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        with self.api_client() as api:
            try:
                client.CoreV1Api(api).delete_node(name)
            except ApiException as e:
                if e.status != 404:
                    raise


# --------------------------------------------------------------------------- #
# virtual kubelet
# --------------------------------------------------------------------------- #


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


class VirtualKubelet:
    """Pretends to be the kubelet of every node labelled ``raytpu.test/virtual-kubelet``.

    Three daemon threads with their own API clients:

    - *pods*: watches pods with ``spec.nodeName`` set. A pod on one of our
      nodes is reported Running + Ready (conditions, container statuses,
      podIP from the node's podCIDR); a pod with a deletionTimestamp is
      finished (deleted with grace period 0) like a kubelet does after the
      containers stopped.
    - *nodes*: watches our nodes; on DELETED it marks that node's pods Failed
      (reason ``NodeShutdown``) and deletes them, like GKE on a preemption.
    - *leases*: renews ``kube-node-lease`` Leases every 10 s so the node
      lifecycle controller keeps the nodes Ready.

    Watches, not polling: idle cost is one Lease update per node per 10 s.
    """

    LEASE_SECONDS = 40
    RENEW_EVERY = 10.0

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._nodes: dict[str, dict[str, Any]] = {}  # name -> {"ip":..., "cidr":..., "next": int}
        self._nodes_lock = threading.Lock()
        self._nodes_synced = threading.Event()
        self._pods_synced = threading.Event()
        self._watches: set = set()
        self._host_pods: dict[str, HostProcessPod] = {}  # pod uid -> its running container
        self.errors: list[str] = []
        # (action, "ns/name"), newest last, for debugging a test.
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=2000)
        self.log_path = cp.logs_dir / "virtual-kubelet.log"
        self.log = logging.getLogger(f"raytpu.virtual_kubelet.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
        self.log.addHandler(handler)

    def _record(self, action: str, what: str) -> None:
        self.events.append((action, what))
        self.log.info("%s %s", action, what)

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        for name, target in (("nodes", self._node_loop), ("pods", self._pod_loop), ("leases", self._lease_loop)):
            t = threading.Thread(target=self._guard(target), name=f"virtual-kubelet-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if not (self._nodes_synced.wait(20) and self._pods_synced.wait(20)):
            raise ControlPlaneError(f"virtual kubelet watches did not start: {self.errors[-5:]}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads: interrupt their watches and join them."""
        self._stop.set()
        # Interrupt the blocked watch reads (else the API server's graceful
        # shutdown waits for these open watches).
        for w in list(self._watches):
            resp = getattr(w, "_resp", None)
            if resp is not None:
                with contextlib.suppress(Exception):
                    resp.shutdown() if hasattr(resp, "shutdown") else resp.close()
        for t in self._threads:
            t.join(timeout)
        for uid in list(self._host_pods):
            self._stop_host_pod(uid)
        if timeout:
            for h in list(self.log.handlers):
                h.close()
                self.log.removeHandler(h)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    fn()
                except Exception as e:  # keep serving; the apiserver may be restarting
                    if self._stop.is_set():
                        return
                    self.errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
                    del self.errors[:-50]
                    self.log.exception("%s failed; restarting it", fn.__name__)
                    self._stop.wait(0.5)
            self.log.info("%s stopped", fn.__name__)
        return run

    def _handle(self, on_event, kind: str, obj) -> None:
        """One object's failure must not stop the others (nor the watch)."""
        try:
            on_event(kind, obj)
        except Exception as e:
            if self._stop.is_set():
                return
            what = f"{getattr(obj.metadata, 'namespace', None)}/{obj.metadata.name}"
            self.errors.append(f"{kind} {what}: {type(e).__name__}: {e}")
            del self.errors[:-50]
            self.log.exception("handling %s %s failed", kind, what)

    def _client(self):
        from kubernetes import client

        return client.CoreV1Api(self.cp.api_client())

    # ------------------------------------------------------------- watching
    def _watch(self, list_fn, on_event, synced: threading.Event, **kwargs) -> None:
        """list, then watch from its resourceVersion; re-list on 410 Gone."""
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        listed = list_fn(**kwargs)
        for obj in listed.items:
            self._handle(on_event, "ADDED", obj)
        synced.set()
        rv = listed.metadata.resource_version
        while not self._stop.is_set():
            w = watch.Watch()
            self._watches.add(w)
            try:
                for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=60,
                                   allow_watch_bookmarks=True, **kwargs):
                    if self._stop.is_set():
                        w.stop()
                        return
                    rv = w.resource_version or rv  # bookmarks included
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._handle(on_event, ev["type"], ev["object"])
            except ApiException as e:
                if e.status != 410:
                    raise
                self.log.info("watch expired (410): re-listing")
                listed = list_fn(**kwargs)  # too old: re-list
                for obj in listed.items:
                    self._handle(on_event, "ADDED", obj)
                rv = listed.metadata.resource_version
            finally:
                self._watches.discard(w)

    # ---------------------------------------------------------------- nodes
    def _node_loop(self) -> None:
        core = self._client()
        self._core_nodes = core

        def on_event(kind: str, node) -> None:
            name = node.metadata.name
            if kind == "DELETED":
                with self._nodes_lock:
                    self._nodes.pop(name, None)
                self._record("node-deleted", name)
                self._node_gone(core, name)
                return
            if self._register_node(node):
                self.renew_lease(name, core)

        self._watch(core.list_node, on_event, self._nodes_synced, label_selector=f"{LABEL_VIRTUAL}=true")

    def _register_node(self, node) -> dict[str, Any] | None:
        """Start serving ``node``; return its info if it was new."""
        ip = next((a.address for a in (node.status.addresses or []) if a.type == "InternalIP"), "10.128.0.2")
        with self._nodes_lock:
            if node.metadata.name in self._nodes:
                return None
            info = self._nodes[node.metadata.name] = {
                "ip": ip, "cidr": node.spec.pod_cidr or "10.200.0.0/24", "next": 2,
                "host_processes": (node.metadata.labels or {}).get(LABEL_HOST_PROCESSES) == "true"}
        self._record("node-added", node.metadata.name)
        return info

    def _node_info(self, core, node_name: str) -> dict[str, Any] | None:
        with self._nodes_lock:
            info = self._nodes.get(node_name)
        if info is not None:
            return info
        # The pod watch may see a binding before the node watch saw the node.
        from kubernetes.client.rest import ApiException

        try:
            node = core.read_node(node_name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        if (node.metadata.labels or {}).get(LABEL_VIRTUAL) != "true":
            return None
        self._register_node(node)
        with self._nodes_lock:
            return self._nodes.get(node_name)

    def _node_gone(self, core, node_name: str) -> None:
        from kubernetes.client.rest import ApiException

        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node_name}").items
        for pod in pods:
            ns, name = pod.metadata.namespace, pod.metadata.name
            self._stop_host_pod(pod.metadata.uid)
            if pod.status.phase not in ("Succeeded", "Failed"):
                with contextlib.suppress(ApiException):
                    core.patch_namespaced_pod_status(name, ns, self._failed_status(pod),
                                                     _content_type="application/strategic-merge-patch+json")
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
            self._record("failed+deleted (node gone)", f"{ns}/{name}")
        with contextlib.suppress(ApiException):
            from kubernetes import client

            client.CoordinationV1Api(core.api_client).delete_namespaced_lease(node_name, "kube-node-lease")

    # ----------------------------------------------------------------- pods
    def _pod_loop(self) -> None:
        core = self._client()

        def on_event(kind: str, pod) -> None:
            if kind == "DELETED":
                self._stop_host_pod(pod.metadata.uid)
                return
            info = self._node_info(core, pod.spec.node_name)
            if info is None:
                return
            self._sync_pod(core, pod, info)

        self._nodes_synced.wait(30)
        self._watch(core.list_pod_for_all_namespaces, on_event, self._pods_synced, field_selector="spec.nodeName!=")

    def _sync_pod(self, core, pod, info: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        ns, name = pod.metadata.namespace, pod.metadata.name
        if pod.metadata.deletion_timestamp is not None:
            self._stop_host_pod(pod.metadata.uid)
            # The containers have stopped: confirm the deletion.
            try:
                core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
                self._record("deleted", f"{ns}/{name}")
            except ApiException as e:
                if e.status != 404:
                    raise
            return
        if pod.status.phase in ("Succeeded", "Failed"):
            return
        if self._is_running_ready(pod):
            return
        if info["host_processes"]:
            self._start_host_pod(pod, info)
            return
        patch = self._running_status(pod, info)
        try:
            core.patch_namespaced_pod_status(name, ns, patch, _content_type="application/strategic-merge-patch+json")
            self._record("running", f"{ns}/{name} on {pod.spec.node_name}")
        except ApiException as e:
            if e.status != 404:
                raise

    @staticmethod
    def _is_running_ready(pod) -> bool:
        st = pod.status
        if st.phase != "Running" or not st.pod_ip:
            return False
        ready = {c.type: c.status for c in (st.conditions or [])}
        if ready.get("Ready") != "True":
            return False
        names = {c.name for c in pod.spec.containers}
        statuses = {c.name: c.ready for c in (st.container_statuses or [])}
        return all(statuses.get(n) for n in names)

    def _allocate_ip(self, info: dict[str, Any]) -> str:
        with self._nodes_lock:
            n = info["next"]
            info["next"] = n + 1
        net = ipaddress.ip_network(info["cidr"], strict=False)
        return str(net.network_address + (n % (net.num_addresses - 2) or 1))

    def _start_host_pod(self, pod, info: dict[str, Any]) -> None:
        """Run the pod's container here; a thread reports it Running + Ready once its probe passes."""
        uid = pod.metadata.uid
        with self._nodes_lock:
            if uid in self._host_pods:
                return
            log_path = self.cp.logs_dir / f"pod-{pod.metadata.namespace}-{pod.metadata.name}.log"
            host_pod = self._host_pods[uid] = HostProcessPod(pod, info["ip"], log_path)
        self._record("started host processes", f"{host_pod.key} (log {log_path.name})")
        threading.Thread(target=self._report_when_ready, args=(pod, info, host_pod),
                         name=f"virtual-kubelet-probe-{pod.metadata.name}", daemon=True).start()

    def _report_when_ready(self, pod, info: dict[str, Any], host_pod: HostProcessPod) -> None:
        from kubernetes.client.rest import ApiException

        if not host_pod.wait_ready(timeout=180, stopping=self._stop):
            if not self._stop.is_set():
                self.errors.append(f"{host_pod.key} never became ready (exit {host_pod.exited()}): "
                                   f"{host_pod.log_tail()}")
            return
        try:
            self._client().patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, self._running_status(pod, info, pod_ip=info["ip"]),
                _content_type="application/strategic-merge-patch+json")
            self._record("running (host processes)", f"{host_pod.key} on {pod.spec.node_name}")
        except ApiException as e:
            if e.status != 404:
                raise

    def _stop_host_pod(self, uid: str) -> None:
        with self._nodes_lock:
            host_pod = self._host_pods.pop(uid, None)
        if host_pod is not None:
            host_pod.stop()
            self._record("stopped host processes", host_pod.key)

    def _running_status(self, pod, info: dict[str, Any], pod_ip: str | None = None) -> dict[str, Any]:
        now = _now().isoformat().replace("+00:00", "Z")
        pod_ip = pod_ip or pod.status.pod_ip or self._allocate_ip(info)
        cond = lambda t: {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}  # noqa: E731

        def cid() -> str:
            return "containerd://" + secrets.token_hex(32)

        init_statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "containerID": cid(), "ready": True, "restartCount": 0, "started": False,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now,
                                     "containerID": None}},
        } for c in (pod.spec.init_containers or [])]
        for s in init_statuses:
            s["state"]["terminated"]["containerID"] = s["containerID"]
        statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "containerID": cid(), "ready": True, "started": True, "restartCount": 0,
            "state": {"running": {"startedAt": now}},
        } for c in pod.spec.containers]
        status: dict[str, Any] = {
            "phase": "Running",
            "hostIP": info["ip"], "hostIPs": [{"ip": info["ip"]}],
            "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
            "startTime": now,
            "qosClass": pod.status.qos_class,
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"),
                           cond("ContainersReady")],
            "containerStatuses": statuses,
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        return {"status": {k: v for k, v in status.items() if v is not None}}

    @staticmethod
    def _failed_status(pod) -> dict[str, Any]:
        now = _now().isoformat().replace("+00:00", "Z")
        statuses = [{
            "name": c.name, "image": c.image, "imageID": f"{c.image}@sha256:{'0' * 64}",
            "ready": False, "started": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}},
        } for c in pod.spec.containers]
        notready = lambda t: {"type": t, "status": "False", "lastTransitionTime": now,  # noqa: E731
                              "reason": "PodFailed"}
        return {"status": {
            "phase": "Failed", "reason": "NodeShutdown",
            "message": "Pod was terminated in response to imminent node shutdown.",
            "conditions": [notready("Ready"), notready("ContainersReady"),
                           {"type": "DisruptionTarget", "status": "True", "lastTransitionTime": now,
                            "reason": "TerminationByKubelet",
                            "message": "Pod was terminated in response to imminent node shutdown."}],
            "containerStatuses": statuses,
        }}

    # --------------------------------------------------------------- leases
    def renew_lease(self, node_name: str, core=None) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = core.api_client if core is not None else getattr(self, "_lease_api", None)
        if api is None:
            api = self._lease_api = self.cp.api_client()
        coord = client.CoordinationV1Api(api)
        now = dt.datetime.now(dt.timezone.utc)
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=node_name, namespace="kube-node-lease"),
            spec=client.V1LeaseSpec(holder_identity=node_name, lease_duration_seconds=self.LEASE_SECONDS,
                                    renew_time=now))
        try:
            coord.patch_namespaced_lease(node_name, "kube-node-lease",
                                         {"spec": {"holderIdentity": node_name,
                                                   "leaseDurationSeconds": self.LEASE_SECONDS,
                                                   "renewTime": now.isoformat().replace("+00:00", "Z")}},
                                         _content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                coord.create_namespaced_lease("kube-node-lease", body)
            except ApiException as e2:
                if e2.status != 409:
                    raise

    def _lease_loop(self) -> None:
        self._lease_api = self.cp.api_client()
        while not self._stop.wait(self.RENEW_EVERY):
            with self._nodes_lock:
                names = list(self._nodes)
            for n in names:
                self.renew_lease(n)


# --------------------------------------------------------------------------- #
# pytest
# --------------------------------------------------------------------------- #


def control_plane_session(request=None, **kwargs: Any) -> Iterator[ControlPlane]:
    """Generator body for a session fixture; skips if binaries are not built.

    With a pytest ``request``, the work dir (component logs) is kept and its
    path printed when a test of the session failed.
    """
    import pytest

    try:
        bin_dir = find_bin_dir()
    except BinariesNotBuilt as e:
        if os.environ.get("RAYTPU_REQUIRE_K8S") == "1":  # `make test` builds them first: never skip there
            pytest.fail(str(e))
        pytest.skip(str(e))
    with ControlPlane.start(bin_dir=bin_dir, **kwargs) as cp:
        print(f"\n[k8s] control plane up in {cp.timings['total']}s at {cp.server} (workdir {cp.workdir}); "
              f"steps: {cp.timings}", file=sys.stderr)
        yield cp
        if request is not None and request.session.testsfailed:
            cp.keep_workdir = True
            print(f"\n[k8s] tests failed: control-plane logs kept in {cp.logs_dir}", file=sys.stderr)


try:
    import pytest as _pytest

    @_pytest.fixture(scope="session")
    def k8s_control_plane(request) -> Iterator[ControlPlane]:
        """Session-wide real control plane (etcd, apiserver, scheduler, KCM, KubeRay)."""
        yield from control_plane_session(request)
except ImportError:  # plain use outside pytest
    pass
