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
(what GKE does on a preemption). On host-process nodes it runs the pods'
containers for real, each pod in a network namespace of its own
(:class:`~tests.controlplane.podnet.PodNetwork`, when this machine allows it), and
GKE's TPU webhook (tests/controlplane/tpuwebhook.py) mutates the TPU pods made in
namespaces that ask for it.

Usage::

    with ControlPlane.start() as cp:
        cp.add_node_pool("v6e-4x4", tpu="tpu-v6e-slice", topology="4x4", num_nodes=8)
        core = kubernetes.client.CoreV1Api(cp.api_client())

or the session fixture :func:`tests.controlplane.session.k8s_control_plane` (import it into a conftest).

Each component logs to ``<tmpdir>/logs/<name>.log``; a component that fails to
start raises :class:`ControlPlaneError` with the tail of its log. Everything
is stopped by PID at exit (SIGTERM, then SIGKILL after a timeout); the
children also get PR_SET_PDEATHSIG so they die with the test process even if it
is killed hard.

This module orchestrates; the pieces are their own modules: ``processes`` (binaries,
ports, one process), ``components`` (each process's command line), ``pki``,
``nodes`` (GKE-like node pools), ``kubelet`` (the virtual kubelet), and the mixins
``startup`` (start and wait: health probes, CRDs) and ``auth`` (token file,
kubeconfigs, ServiceAccount tokens); ``session`` has the pytest fixture.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.controlplane.auth import Credentials
from tests.controlplane.components import (
    apiserver_argv,
    controller_manager_argv,
    etcd_argv,
    operator_argv,
    operator_env,
    scheduler_argv,
)
from tests.controlplane.kubelet import VirtualKubelet
from tests.controlplane.nodes import GkeNodePools
from tests.controlplane.pki import write_pki
from tests.controlplane.podnet import PodNetwork, PodNetworkUnavailable
from tests.controlplane.startup import StartupWaits
from tests.controlplane.tpuwebhook import NAMESPACE_LABEL as TPU_WEBHOOK_LABEL
from tests.controlplane.tpuwebhook import TpuWebhook
from tests.support.processes import BinariesNotBuilt, Component, ControlPlaneError, find_bin_dir, free_ports

__all__ = ["BinariesNotBuilt", "ControlPlane", "ControlPlaneError", "VirtualKubelet"]


@dataclass
class _Identity:
    user: str
    groups: tuple[str, ...]
    token: str = field(default_factory=lambda: secrets.token_hex(24))


class ControlPlane(StartupWaits, Credentials):
    """etcd + kube-apiserver + scheduler + controller-manager + KubeRay operator.

    Attributes: ``server`` (https URL), ``admin_token``, ``ca_path``,
    ``kubeconfig_path`` (admin), ``workdir`` (temp dir), ``logs_dir``, ``audit_log_path``,
    ``crd_dir``, ``timings`` (seconds per startup step), ``components``,
    ``pod_network`` (``None`` when this machine does not allow one: then
    ``pod_network_problem`` says why, and host-process pods share its address),
    ``tpu_webhook``.
    """

    def __init__(self, *, bin_dir: Path | None = None, workdir: Path | None = None,
                 crd_dir: Path | None = None, keep_workdir: bool | None = None,
                 operator_args: list[str] | None = None,
                 kubelet: bool = True, pod_network: bool | None = None) -> None:
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
        if pod_network is None:  # RAYTPU_K8S_POD_NETWORK=0 tries the single-head fallback
            pod_network = os.environ.get("RAYTPU_K8S_POD_NETWORK", "1") != "0"
        self._want_pod_network = pod_network and kubelet
        self.pod_network: PodNetwork | None = None
        self.pod_network_problem = "" if self._want_pod_network else "pod networks turned off"
        self.tpu_webhook: TpuWebhook | None = None
        self._stopped = False
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
         self.kcm_port, self.operator_metrics_port, self.operator_probe_port) = free_ports(7)
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.pki: dict[str, Path] = {}
        self.ca_path: Path = self.workdir / "pki" / "ca.crt"
        self.kubeconfig_path: Path = self.workdir / "admin.kubeconfig"
        self.audit_policy_path: Path = self.workdir / "audit-policy.json"
        #: The API server's audit log (JSON lines), read by ``tests/controlplane/audit.py``.
        self.audit_log_path: Path = self.logs_dir / "audit.log"
        self.gke_nodes = GkeNodePools(self.api_client, self._controller_manager_log,
                                      lambda: self.pod_network is not None)

    def _controller_manager_log(self) -> str:
        kcm = self.components.get("kube-controller-manager")
        return kcm.log_tail(30) if kcm is not None else "(not started)"

    # ------------------------------------------------------------------ start
    @classmethod
    @contextlib.contextmanager
    def start(cls, **kwargs: Any) -> Iterator[ControlPlane]:
        """Context manager: start everything, yield the control plane, stop."""
        cp = cls(**kwargs)
        try:
            cp.up()
            yield cp
        finally:
            cp.stop()

    def up(self, timeout: float = 120.0) -> ControlPlane:
        """Start everything (stopping what was started if a step fails)."""
        atexit.register(self.stop)
        try:
            return self._up(timeout)
        except BaseException:
            self.keep_workdir = True  # keep the component logs for a post-mortem
            self.stop()
            raise

    def _up(self, timeout: float) -> ControlPlane:
        t0 = time.monotonic()
        deadline = t0 + timeout

        def step(name: str, fn: Callable[[], Any]) -> Any:
            s = time.monotonic()
            out = fn()
            self.timings[name] = round(time.monotonic() - s, 2)
            return out

        self.pki = step("pki", lambda: write_pki(self.workdir / "pki"))
        self.ca_path = self.pki["ca_crt"]
        self._write_auth_files()

        step("etcd", lambda: self._start_and_wait(
            self._component("etcd", etcd_argv(self)), self._etcd_healthy, deadline))
        step("kube-apiserver", lambda: self._start_and_wait(
            self._component("kube-apiserver", apiserver_argv(self)), self._apiserver_ready, deadline))
        # The scheduler does not need the CRDs: it comes up while they are
        # being established. The controller manager starts after them: its
        # garbage collector would otherwise learn about ray.io kinds only at
        # its next discovery resync (30 s), and deleting a RayCluster would
        # leave its pods for that long.
        sched = self._component("kube-scheduler", scheduler_argv(self))
        sched.spawn()
        step("crds", lambda: self._apply_crds(deadline))
        kcm = self._component("kube-controller-manager", controller_manager_argv(self))
        kcm.spawn()
        step("kuberay-operator", lambda: self._start_and_wait(
            self._component("kuberay-operator", operator_argv(self), operator_env(self)), self._operator_ready,
            deadline))
        step("kube-scheduler", lambda: self._wait(sched, lambda: self._https_healthz(self.scheduler_port), deadline))
        step("kube-controller-manager", lambda: self._wait(kcm, lambda: self._https_healthz(self.kcm_port), deadline))
        step("default-serviceaccount", lambda: self._wait_default_service_account(deadline))
        self.tpu_webhook = TpuWebhook(self.request, self.logs_dir / "tpu-webhook.log")
        step("tpu-webhook", self.tpu_webhook.start)
        if self._want_pod_network:
            try:
                self.pod_network = step("pod-network", PodNetwork.create)
            except PodNetworkUnavailable as e:
                self.pod_network_problem = str(e)
        if self._want_kubelet:
            self.kubelet = VirtualKubelet(self, self.pod_network)
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
        if self.pod_network is not None:
            self.pod_network.close()
        if self.tpu_webhook is not None:
            self.tpu_webhook.stop()
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

    # --------------------------------------------------------------- components
    def _component(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        comp = Component(name, argv, self.logs_dir / f"{name}.log", env)
        self.components[name] = comp
        return comp

    def _ssl_ctx(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki["ca_crt"]))

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str = "application/json", timeout: float = 10.0,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """Raw admin HTTP request to the API server (no client model parsing)."""
        req = urllib.request.Request(self.server + path, data=body, method=method, headers={
            "Authorization": f"Bearer {self.admin_token}", "Content-Type": content_type,
            "Accept": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, context=self._ssl_ctx(), timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # --------------------------------------------------------- namespaces
    def create_namespace(self, name: str, timeout: float = 30.0, *, tpu_webhook: bool = False,
                         labels: dict[str, str] | None = None) -> str:
        """Create a namespace and wait for its ``default`` ServiceAccount
        (pods are rejected until the serviceaccount controller made it).

        :param tpu_webhook: GKE's TPU webhook (tests/controlplane/tpuwebhook.py) mutates the TPU pods made in it.
        :param labels: more labels, e.g. the one that lets Kueue's webhooks in (tests/controlplane/kueue.py).
        """
        labels = {**({TPU_WEBHOOK_LABEL: "enabled"} if tpu_webhook else {}), **(labels or {})}
        body = json.dumps({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": labels}}).encode()
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
    def add_node_pool(self, name: str, **options: Any) -> list[str]:
        """Create Nodes that look like a GKE node pool; return their names.

        CPU pool: ``add_node_pool("cpu", cpu_nodes=1)``. TPU pool:
        ``add_node_pool("v6e", tpu="tpu-v6e-slice", topology="4x4", num_nodes=8)``.
        Again with the same ``name``: more nodes in that pool. Every option:
        :meth:`tests.controlplane.nodes.GkeNodePools.add`.
        """
        return self.gke_nodes.add(name, **options)

    def delete_node_pool(self, name: str) -> list[str]:
        """Delete every Node of pool ``name``; return their names."""
        return self.gke_nodes.delete_pool(name)

    def delete_node(self, name: str) -> None:
        """Delete a Node (like a GKE preemption / node-pool scale-down); the
        virtual kubelet fails and deletes its pods."""
        self.gke_nodes.delete_node(name)
