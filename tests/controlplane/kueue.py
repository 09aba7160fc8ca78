"""Kueue v0.17 on the test control plane: its real manager (built from its Go module by
``build_binaries.sh --kueue``), its CRDs, and its webhooks registered with the API server.

Kueue is installed the way its release manifests install it, with three differences a machine without
a pod network for it asks for:

- the manager runs as a process of this machine (admin kubeconfig, no leader election), not a pod, so
  the kubelet's part, mounting the certificate Secret into its ``certDir``, is done here: the Secret's
  keys are written there once Kueue's rotator has filled it;
- its webhook Service ``kueue-system/kueue-webhook-service`` is an ``ExternalName`` for ``localhost``:
  the API server resolves a webhook's service through the Service (``ResolveCluster`` in
  k8s.io/apiserver ``pkg/util/proxy``), dials ``localhost:<port>`` and still checks the certificate
  for ``kueue-webhook-service.kueue-system.svc``, which Kueue's internal certificate management
  (cert-controller) issues and injects into the webhook registrations and CRDs, as in a cluster;
- of its webhook registrations (``config/components/webhook/manifests.yaml``) only those for its own
  kinds and for ``rayclusters`` are kept, the RayCluster ones limited to namespaces labelled
  :data:`NAMESPACE_LABEL` ``=enabled``, so other modules' clusters never meet a webhook of a Kueue
  that has stopped. Only the ``ray.io/raycluster`` integration is on.

Usage::

    with Kueue.start(control_plane) as kueue:
        ns = control_plane.create_namespace("q", labels={NAMESPACE_LABEL: "enabled"})
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.controlplane.controlplane import ControlPlane
from tests.support.processes import BUILD_SCRIPT, BinariesNotBuilt, Component, ControlPlaneError, free_ports

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
NAMESPACE_LABEL = "raytpu.test/kueue"
API = "/apis/kueue.x-k8s.io/v1beta2"
# The CRDs whose conversion webhook Kueue's certificate rotator fills in (pkg/util/cert/cert.go).
CONVERTED = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")
REGISTRATIONS = {"MutatingWebhookConfiguration": ("mutatingwebhookconfigurations",
                                                  "kueue-mutating-webhook-configuration"),
                 "ValidatingWebhookConfiguration": ("validatingwebhookconfigurations",
                                                    "kueue-validating-webhook-configuration")}


def find_kueue_dir() -> Path:
    """Kueue's build (``build_binaries.sh --kueue``): ``bin/kueue``, ``crds/``, ``webhooks.yaml``."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "--kueue-dir"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BinariesNotBuilt(f"Kueue is not built; run `make kueue`. {proc.stderr.strip()}")
    return Path(proc.stdout.strip().splitlines()[-1])


class Kueue:
    """Kueue's manager on ``cp``, with its CRDs and webhooks. ``objects`` names what a test made (deleted at stop).

    :param cp: the control plane.
    :param directory: Kueue's build.
    """

    def __init__(self, cp: ControlPlane, directory: Path) -> None:
        self.cp = cp
        self.directory = directory
        self.webhook_port, self.probe_port = free_ports(2)
        self.workdir = cp.workdir / "kueue"
        self.component: Component | None = None

    @classmethod
    @contextlib.contextmanager
    def start(cls, cp: ControlPlane) -> Iterator[Kueue]:
        kueue = cls(cp, find_kueue_dir())
        try:
            kueue.up()
            yield kueue
        finally:
            kueue.stop()

    def up(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cp.create_namespace(NAMESPACE)
        self._create("/api/v1/namespaces/kueue-system/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": "localhost"}})
        self._create("/api/v1/namespaces/kueue-system/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NAMESPACE}})
        self._register_webhooks()
        self._apply_crds(deadline)
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration()))
        self.component = Component("kueue", [str(self.directory / "bin" / "kueue"), f"--config={config}",
                                             "--feature-gates=VisibilityOnDemand=false"],
                                   self.cp.logs_dir / "kueue.log",
                                   {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig_path)})
        self.component.spawn()
        self._mount_certificates(deadline)
        self.cp._wait(self.component, self._ready, deadline)
        # Ready means its certificates are in place; the webhooks answer once their registrations carry the CA.
        self._wait_for_ca(deadline)

    def configuration(self) -> dict[str, Any]:
        """Kueue's Configuration (``config.kueue.x-k8s.io/v1beta2``)."""
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.probe_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.webhook_port, "certDir": str(self.workdir / "certs")},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE, "webhookSecretName": SECRET},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["ray.io/raycluster"]},
        }

    def stop(self) -> None:
        """Stop the manager and remove its webhook registrations (the CRDs and their objects stay)."""
        for plural, name in REGISTRATIONS.values():
            self.cp.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}")
        if self.component is not None:
            self.component.stop()

    def log_tail(self, lines: int = 60) -> str:
        return self.component.log_tail(lines) if self.component else "(not started)"

    # -- objects a test makes -------------------------------------------------------------------

    def flavor(self, name: str, node_labels: dict[str, str]) -> None:
        """A ResourceFlavor whose admitted pods get ``node_labels``."""
        self._create(f"{API}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                                "metadata": {"name": name}, "spec": {"nodeLabels": node_labels}})

    def cluster_queue(self, name: str, groups: list[tuple[list[str], dict[str, dict[str, str]]]]) -> None:
        """A ClusterQueue: per resource group, its resources and each flavor's nominal quota of them."""
        self._create(f"{API}/clusterqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {}, "resourceGroups": [
                {"coveredResources": resources,
                 "flavors": [{"name": flavor, "resources": [{"name": r, "nominalQuota": quota[r]} for r in resources]}
                             for flavor, quota in flavors.items()]}
                for resources, flavors in groups]}})

    def local_queue(self, namespace: str, name: str, cluster_queue: str) -> None:
        self._create(f"{API}/namespaces/{namespace}/localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": cluster_queue}})

    def workloads(self, namespace: str) -> list[dict[str, Any]]:
        status, body = self.cp.request("GET", f"{API}/namespaces/{namespace}/workloads")
        if status != 200:
            raise ControlPlaneError(f"listing workloads: HTTP {status}: {body[:500]!r}")
        return json.loads(body)["items"]

    def delete_cluster_queue(self, name: str) -> None:
        self.cp.request("DELETE", f"{API}/clusterqueues/{name}")

    # -- installation ----------------------------------------------------------------------------

    def _create(self, path: str, body: dict[str, Any]) -> None:
        status, out = self.cp.request("POST", path, json.dumps(body).encode())
        if status not in (200, 201, 409):
            raise ControlPlaneError(
                f"creating {body['kind']} {body['metadata']['name']}: HTTP {status}: {out[:1000]!r}")

    def _service(self, path: str) -> dict[str, Any]:
        return {"name": SERVICE, "namespace": NAMESPACE, "path": path, "port": self.webhook_port}

    def _register_webhooks(self) -> None:
        for document in yaml.load_all((self.directory / "webhooks.yaml").read_text(), Loader=yaml.CSafeLoader):
            plural, name = REGISTRATIONS[document["kind"]]
            kept = []
            for webhook in document["webhooks"]:
                groups = {g for rule in webhook.get("rules") or [] for g in rule.get("apiGroups") or []}
                resources = {r for rule in webhook.get("rules") or [] for r in rule.get("resources") or []}
                if groups == {"ray.io"} and resources == {"rayclusters"}:
                    webhook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "enabled"}}
                elif groups != {"kueue.x-k8s.io"}:
                    continue
                webhook["clientConfig"] = {"service": self._service(webhook["clientConfig"]["service"]["path"])}
                kept.append(webhook)
            body = {**document, "metadata": {"name": name}, "webhooks": kept}
            self.cp.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}")  # an earlier port
            self._create(f"/apis/admissionregistration.k8s.io/v1/{plural}", body)

    def _apply_crds(self, deadline: float) -> None:
        names = []
        for path in sorted((self.directory / "crds").glob("*.yaml")):
            crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
            if crd["spec"]["names"]["plural"] in CONVERTED:
                crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                    "clientConfig": {"service": self._service("/convert")}, "conversionReviewVersions": ["v1"]}}
            status, out = self.cp.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                          json.dumps(crd).encode(), timeout=60)
            if status == 409:  # made by an earlier Kueue of this session: point its conversion at this port
                current = json.loads(self.cp.request(
                    "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}")[1])
                crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                status, out = self.cp.request(
                    "PUT", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
                    json.dumps(crd).encode(), timeout=60)
            if status not in (200, 201):
                raise ControlPlaneError(f"creating CRD {path.name}: HTTP {status}: {out[:1000]!r}")
            names.append(crd["spec"]["names"]["plural"])
        while True:
            status, body = self.cp.request("GET", API)
            if status == 200 and set(names) <= {r["name"] for r in json.loads(body).get("resources", [])}:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"Kueue's resources {sorted(names)} not served in time")
            time.sleep(0.2)

    def _mount_certificates(self, deadline: float) -> None:
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        while True:
            status, body = self.cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
            data = (json.loads(body).get("data") or {}) if status == 200 else {}
            if {"tls.crt", "tls.key", "ca.crt"} <= set(data):
                for key, value in data.items():
                    (certs / key).write_bytes(base64.b64decode(value))
                return
            if time.monotonic() > deadline or self.component is None or not self.component.alive():
                raise ControlPlaneError(f"Kueue filled no certificate Secret in time; log:\n{self.log_tail()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/readyz", timeout=2) as answer:
            return answer.status == 200

    def _wait_for_ca(self, deadline: float) -> None:
        plural, name = REGISTRATIONS["MutatingWebhookConfiguration"]
        while True:
            status, body = self.cp.request("GET", f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}")
            if status == 200 and all(w["clientConfig"].get("caBundle") for w in json.loads(body)["webhooks"]):
                return
            if time.monotonic() > deadline or self.component is None or not self.component.alive():
                raise ControlPlaneError(f"Kueue's webhooks got no CA in time; log:\n{self.log_tail()}")
            time.sleep(0.2)
