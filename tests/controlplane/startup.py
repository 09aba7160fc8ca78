"""Starting the control plane's components (controlplane.py) and waiting for each: a component that exits
fails at once with its log, the health probes of etcd, the API server, the scheduler, the controller
manager and the operator, the KubeRay CRDs created and Established, the ``default`` ServiceAccount.

A mixin: the control plane owns the components, their ports, the CRD directory and ``request``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.processes import Component, ControlPlaneError


class StartupWaits:
    """The control plane's ``_start_and_wait``, ``_wait``, health probes, ``_apply_crds`` and
    ``_wait_default_service_account``."""

    components: dict[str, Component]
    crd_dir: Path
    crd_names: list[str]
    etcd_port: int
    operator_probe_port: int
    request: Callable[..., tuple[int, bytes]]

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
