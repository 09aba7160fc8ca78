"""Stand-in for the KubeRay TPU webhook of GKE's Ray add-on: a real mutating admission webhook.

On GKE, a mutating webhook (ai-on-gke/kuberay-tpu-webhook) intercepts the creation of every KubeRay
pod that requests ``google.com/tpu`` and adds what multi-host TPU initialisation needs; KubeRay
itself sets none of it. This module follows that webhook's ``mutatePod`` (main.go) and its
registration (deployments/mutating-webhook-cfg.yaml: pods, CREATE, objectSelector
``app.kubernetes.io/name: kuberay``, every namespace but kube-system and kube-node-lease):

- the slice (replica) index and host index: from KubeRay's ``ray.io/worker-group-replica-index``
  and ``ray.io/replica-host-index`` labels (KubeRay >= 1.5 with ``RayMultiHostIndexing``), else
  assigned the legacy way (``legacyAssignIndices``: the lowest replica with a free host, the lowest
  free ``TPU_WORKER_ID`` in it, recorded in a ``replicaIndex`` label);
- for a multi-host slice, ``spec.hostname`` ``<group>-<replica>-<host>`` and ``spec.subdomain``
  ``<cluster>-headless``, and ``TPU_WORKER_HOSTNAMES`` (the slice's hosts under that subdomain);
- ``TPU_WORKER_ID``, ``TPU_NAME`` (``<group>-<replica>``), ``TPU_DEVICE_PLUGIN_HOST_IP``
  (``status.hostIP``) and ``TPU_DEVICE_PLUGIN_ADDR``;
- ``MEGASCALE_SLICE_ID``, ``MEGASCALE_COORDINATOR_ADDRESS`` and ``MEGASCALE_PORT`` when the
  container sets ``MEGASCALE_NUM_SLICES``.

Left out: the pod (anti-)affinity the webhook adds to keep a multi-host slice in one node pool
(the harness's node pools hold several slices each, which GKE never does), v7x's multi-container
``TPU_PROCESS_*`` variables, and the webhook's validation of RayClusters.

The server runs in a thread of the test process (TLS with a throwaway CA from ``trustme``); the API
server calls it at ``https://127.0.0.1:<port>/mutate``. It applies only in namespaces labelled
:data:`NAMESPACE_LABEL` ``=enabled`` (``ControlPlane.create_namespace(name, tpu_webhook=True)``), so
one session holds namespaces with and without GKE's Ray add-on.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TPU = "google.com/tpu"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SUBSLICE_ANNOTATION = "cloud.google.com/gke-tpu-slice-topology"
REPLICA_INDEX = "ray.io/worker-group-replica-index"
HOST_INDEX = "ray.io/replica-host-index"
LEGACY_REPLICA_LABEL = "replicaIndex"
MEGASCALE_PORT = 8081
DEVICE_PLUGIN_PORT = 2112
CONFIGURATION_NAME = "kuberay-tpu-mutating-webhook-cfg"
NAMESPACE_LABEL = "raytpu.test/tpu-webhook"

ListPods = Callable[[str, str, str], list[dict[str, Any]]]


def _chips(container: dict[str, Any]) -> int:
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):  # the request wins; the limit when there is none
        value = (resources.get(kind) or {}).get(TPU)
        if value not in (None, "", "0", 0):
            return int(str(value))
    return 0


def check_name(name: str) -> str:
    """KubeRay's ``utils.CheckName``: at most 50 characters (cut from the front), starting with a letter."""
    if len(name) > 50:
        name = name[len(name) - 50:]
    if not name[0].isalpha():
        name = "r" + name[1:]
    return name


def _env_value(container: dict[str, Any], name: str) -> tuple[str, bool]:
    """(value, exists) of a container's variable; a ``valueFrom`` one exists with value ''."""
    for var in container.get("env") or []:
        if var.get("name") == name:
            if var.get("value"):
                return var["value"], True
            if var.get("valueFrom"):
                return "", True
    return "", False


def _hosts_in_slice(topology: str, chips_per_host: int) -> int:
    chips = 1
    for dim in topology.split("x"):
        chips *= int(dim)
    return max(chips // chips_per_host, 1)


class _Patches:
    """A JSON patch under construction; adds to a container's env the way ``addEnvVarPatch`` does."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []

    def add(self, path: str, value: Any) -> None:
        self.ops.append({"op": "add", "path": path, "value": value})

    def add_env(self, index: int, var: dict[str, Any], has_env: bool) -> bool:
        path = f"/spec/containers/{index}/env"
        self.add(f"{path}/-", var) if has_env else self.add(path, [var])
        return True


def legacy_indices(pods: list[dict[str, Any]], group: str, num_hosts: int) -> tuple[int, int]:
    """``legacyAssignIndices``: the replica with a free host (lowest index), else the next one; the lowest
    free worker id in it. ``pods`` are the group's pods (terminating ones are skipped).

    :param pods: the existing pods of the cluster's worker group.
    :param group: the worker group's name.
    :param num_hosts: hosts per slice.
    """
    hosts: dict[int, list[int]] = {}
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        label = (pod["metadata"].get("labels") or {}).get(LEGACY_REPLICA_LABEL, "")
        tpu_containers = [c for c in pod["spec"]["containers"] if _chips(c)]
        if not label or not tpu_containers:
            continue
        worker_id, _ = _env_value(tpu_containers[0], "TPU_WORKER_ID")
        if worker_id.isdigit():
            hosts.setdefault(int(label.rsplit("-", 1)[-1]), []).append(int(worker_id) // len(tpu_containers))
    if not hosts:
        return 0, 0
    free = [replica for replica, used in hosts.items() if len(used) < num_hosts]
    replica = min(free) if free else len(hosts)
    used = sorted(hosts.get(replica, []))
    worker = next((i for i, taken in enumerate(used) if i != taken), len(used))
    return replica, worker


def pod_patches(pod: dict[str, Any], namespace: str, list_pods: ListPods) -> list[dict[str, Any]]:
    """The JSON patch the TPU webhook applies to a new pod (empty when it requests no TPU chips).

    :param pod: the pod being created, as the admission request carries it.
    :param namespace: the request's namespace.
    :param list_pods: ``(namespace, cluster, group)`` -> that worker group's pods (legacy indexing).
    :raises ValueError: what the webhook refuses (no cluster or group label, no topology selector).
    """
    containers = pod["spec"]["containers"]
    if not any(_chips(c) for c in containers):
        return []
    labels = pod["metadata"].get("labels") or {}
    cluster, group = labels.get("ray.io/cluster"), labels.get("ray.io/group")
    if not cluster or not group:
        raise ValueError("Ray Pod created by KubeRay missing RayCluster or Group label")
    topology = (pod["metadata"].get("annotations") or {}).get(SUBSLICE_ANNOTATION) or \
        (pod["spec"].get("nodeSelector") or {}).get(TOPOLOGY_LABEL)
    if not topology:
        raise ValueError("Ray Pod created by KubeRay missing TPU topology nodeSelector")
    num_hosts = _hosts_in_slice(topology, sum(_chips(c) for c in containers))
    patches = _Patches()
    if REPLICA_INDEX in labels and HOST_INDEX in labels:
        replica, host = int(labels[REPLICA_INDEX]), int(labels[HOST_INDEX])
    else:
        replica, host = legacy_indices(list_pods(namespace, cluster, group), group, num_hosts)
        patches.add(f"/metadata/labels/{LEGACY_REPLICA_LABEL}", f"{group}-{replica}")
    headless = check_name(f"{cluster}-headless")
    if num_hosts > 1:
        patches.add("/spec/hostname", f"{group}-{replica}-{host}")
        patches.add("/spec/subdomain", headless)
    for index, container in enumerate(containers):
        if not _chips(container):
            continue
        has_env = bool(container.get("env"))

        def unset(name: str, container: dict[str, Any] = container) -> bool:
            return _env_value(container, name)[0] == ""

        if _env_value(container, "MEGASCALE_NUM_SLICES")[1]:
            if unset("MEGASCALE_SLICE_ID"):
                has_env = patches.add_env(index, {"name": "MEGASCALE_SLICE_ID", "value": str(replica)}, has_env)
            if unset("MEGASCALE_COORDINATOR_ADDRESS"):
                has_env = patches.add_env(index, {"name": "MEGASCALE_COORDINATOR_ADDRESS",
                                                  "value": f"{group}-0-0.{headless}"}, has_env)
            if unset("MEGASCALE_PORT"):
                has_env = patches.add_env(index, {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)}, has_env)
        if num_hosts > 1 and _env_value(container, "TPU_WORKER_HOSTNAMES")[0] in ("", "localhost"):
            hostnames = ",".join(f"{group}-{replica}-{h}.{headless}" for h in range(num_hosts))
            has_env = patches.add_env(index, {"name": "TPU_WORKER_HOSTNAMES", "value": hostnames}, has_env)
        worker_id = _env_value(container, "TPU_WORKER_ID")[0]
        if worker_id == "" or (worker_id == "0" and worker_id != str(host)):
            has_env = patches.add_env(index, {"name": "TPU_WORKER_ID", "value": str(host)}, has_env)
        if unset("TPU_NAME"):
            has_env = patches.add_env(index, {"name": "TPU_NAME", "value": f"{group}-{replica}"}, has_env)
        if not _env_value(container, "TPU_DEVICE_PLUGIN_HOST_IP")[1]:
            has_env = patches.add_env(index, {"name": "TPU_DEVICE_PLUGIN_HOST_IP",
                                              "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}, has_env)
        if unset("TPU_DEVICE_PLUGIN_ADDR"):
            has_env = patches.add_env(index, {"name": "TPU_DEVICE_PLUGIN_ADDR",
                                              "value": f"$(TPU_DEVICE_PLUGIN_HOST_IP):{DEVICE_PLUGIN_PORT}"}, has_env)
    return patches.ops


class TpuWebhook:
    """The webhook server and its ``MutatingWebhookConfiguration``; :meth:`stop` removes both.

    :param api_request: ``(method, path, body)`` -> ``(status, body)`` as the admin (the
        control plane's ``request``): registers the configuration and lists pods.
    :param log_path: where the patches of every admitted pod are logged.
    """

    def __init__(self, api_request: Callable[..., tuple[int, bytes]], log_path: Path) -> None:
        self._api = api_request
        self.log_path = log_path
        self._lock = threading.Lock()
        self._last_admitted: tuple[str, str, str, str, str] | None = None
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(context)
        webhook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
                review = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                body = json.dumps(webhook.review(review)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tpu-webhook", daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        configuration = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION_NAME},
            "webhooks": [{
                "name": "kuberay-tpu-webhook.ray-system.svc",
                "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun", "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "namespaceSelector": {
                    "matchLabels": {NAMESPACE_LABEL: "enabled"},
                    "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                          "values": ["kube-system", "kube-node-lease"]}]},
                "objectSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay"}},
                "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate",
                                 "caBundle": base64.b64encode(ca.cert_pem.bytes()).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                           "resources": ["pods"], "scope": "Namespaced"}],
            }],
        }
        status, out = self._api("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
                                json.dumps(configuration).encode())
        if status not in (200, 201):
            raise RuntimeError(f"registering the TPU webhook: HTTP {status}: {out[:500]!r}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._api("DELETE",
                      f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{CONFIGURATION_NAME}")
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _list_group(self, namespace: str, cluster: str, group: str) -> list[dict[str, Any]]:
        selector = f"ray.io/cluster={cluster},ray.io/group={group}"
        status, body = self._api("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")
        if status != 200:
            raise RuntimeError(f"listing the pods of {namespace}/{cluster} group {group}: HTTP {status}")
        return json.loads(body)["items"]

    def _list_group_after_last_admission(self, namespace: str, cluster: str, group: str) -> list[dict[str, Any]]:
        """Like the webhook's informer wait (``cacheCond.Wait(1s)``): the pod admitted last is listed
        before the next one is indexed, so two pods admitted back to back never share an index."""
        deadline = time.monotonic() + 1.0
        while True:
            pods = self._list_group(namespace, cluster, group)
            last = self._last_admitted
            if last is None or last[:3] != (namespace, cluster, group) or time.monotonic() > deadline or any(
                    (p["metadata"].get("labels") or {}).get(LEGACY_REPLICA_LABEL) == last[3]
                    and _env_value(next(c for c in p["spec"]["containers"] if _chips(c)), "TPU_WORKER_ID")[0] == last[4]
                    for p in pods if any(_chips(c) for c in p["spec"]["containers"])):
                return pods
            time.sleep(0.05)

    def review(self, review: dict[str, Any]) -> dict[str, Any]:
        """Answer one AdmissionReview: allowed, with the JSON patch; refused with the reason on bad input."""
        request = review["request"]
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        pod = request.get("object") or {}
        try:
            with self._lock:
                patches = pod_patches(pod, request.get("namespace", ""), self._list_group_after_last_admission)
                legacy = next((p["value"] for p in patches if p["path"].endswith(f"/{LEGACY_REPLICA_LABEL}")), None)
                if legacy is not None:
                    labels = pod["metadata"].get("labels") or {}
                    self._last_admitted = (request.get("namespace", ""), labels["ray.io/cluster"],
                                           labels["ray.io/group"], legacy, _worker_id_in(patches))
        except ValueError as error:
            response.update(allowed=False, status={"status": "Failure", "message": str(error), "code": 403})
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        if patches:
            response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(patches).encode()).decode())
            what = f"{request.get('namespace')}/{pod['metadata'].get('generateName') or pod['metadata'].get('name')}"
            with open(self.log_path, "a") as log:
                log.write(f"{time.strftime('%H:%M:%S')} {what}: {json.dumps(patches)}\n")
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _worker_id_in(patches: list[dict[str, Any]]) -> str:
    for patch in patches:
        values = patch["value"] if isinstance(patch["value"], list) else [patch["value"]]
        for value in values:
            if isinstance(value, dict) and value.get("name") == "TPU_WORKER_ID":
                return str(value["value"])
    return ""
