"""The virtual kubelet: makes the fake GKE nodes of a :class:`~tests.controlplane.controlplane.ControlPlane`
look alive (Leases, pod statuses, pod deletion, node loss), and on a host-process node really runs
the pod's containers (tests/controlplane/hostpods.py), each pod in a network namespace of its own
(tests/controlplane/podnet.py) whose hosts file is the cluster DNS (tests/controlplane/clusterdns.py).

Its mixins: ``watchloops`` (guarded loops, list-then-watch), ``podstatus`` (the statuses it reports),
``leases`` (node Leases) and ``startslots`` (containers start one at a time)."""

from __future__ import annotations

import collections
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.controlplane.clusterdns import dns_records
from tests.controlplane.hostpods import LABEL_HOST_PROCESSES, HostProcessPod, NodeFacts
from tests.controlplane.leases import NodeLeases
from tests.controlplane.nodes import LABEL_VIRTUAL, TPU_RESOURCE
from tests.controlplane.podnet import PodNetwork
from tests.controlplane.podstatus import PodStatuses
from tests.controlplane.startslots import StartSlots
from tests.controlplane.watchloops import WatchLoops
from tests.support.processes import ControlPlaneError

if TYPE_CHECKING:
    from tests.controlplane.controlplane import ControlPlane


class VirtualKubelet(WatchLoops, PodStatuses, NodeLeases, StartSlots):
    """Pretends to be the kubelet of every node labelled ``raytpu.test/virtual-kubelet``.

    Three daemon threads with their own API clients (four with a pod network):

    - *pods*: watches pods with ``spec.nodeName`` set. A pod on one of our
      nodes is reported Running + Ready (conditions, container statuses,
      podIP from the node's podCIDR); a pod with a deletionTimestamp is
      finished (deleted with grace period 0) like a kubelet does after the
      containers stopped.
    - *nodes*: watches our nodes; on DELETED it marks that node's pods Failed
      (reason ``NodeShutdown``) and deletes them, like GKE on a preemption.
    - *leases*: renews ``kube-node-lease`` Leases every 10 s so the node
      lifecycle controller keeps the nodes Ready.
    - *dns*: watches EndpointSlices and keeps the pods' hosts files (their cluster DNS) current.

    A pod on a host-process node gets its own network namespace and IP from ``network`` (when
    given) and its containers run for real; it is reported Running + Ready, with that IP, once its
    readiness probe passes.

    Watches, not polling: idle cost is one Lease update per node per 10 s.
    """

    def __init__(self, cp: ControlPlane, network: PodNetwork | None = None) -> None:
        self.cp = cp
        self.network = network
        self._stop = threading.Event()
        StartSlots.__init__(self)
        self._threads: list[threading.Thread] = []
        self._nodes: dict[str, dict[str, Any]] = {}  # name -> {"ip":..., "cidr":..., "next": int}
        self._nodes_lock = threading.Lock()
        self._nodes_synced = threading.Event()
        self._pods_synced = threading.Event()
        self._watches: set = set()
        self._host_pods: dict[str, HostProcessPod] = {}  # pod uid -> its running containers
        self._endpoint_slices: dict[str, dict[str, Any]] = {}  # uid -> EndpointSlice (dict), for the DNS
        self.errors: list[str] = []
        # (action, "ns/name"), newest last, for debugging a test.
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=2000)
        # Ray's files of each host-process pod, under a short path: Ray's Unix sockets live below it
        # and their paths may not exceed 107 bytes.
        self._ray_tmp_root = Path(tempfile.mkdtemp(prefix="rtpu", dir="/tmp"))
        self.log_path = cp.logs_dir / "virtual-kubelet.log"
        self.log = logging.getLogger(f"raytpu.virtual_kubelet.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
        self.log.addHandler(handler)

    def host_pod(self, namespace: str, name: str) -> HostProcessPod | None:
        """The running processes of pod ``namespace/name``, if this kubelet runs them."""
        with self._nodes_lock:
            return next((p for p in self._host_pods.values() if p is not None and p.key == f"{namespace}/{name}"),
                        None)

    def _record(self, action: str, what: str) -> None:
        self.events.append((action, what))
        self.log.info("%s %s", action, what)

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        loops = [("nodes", self._node_loop), ("pods", self._pod_loop), ("leases", self._lease_loop)]
        if self.network is not None:
            loops.append(("dns", self._dns_loop))
        for name, target in loops:
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
        shutil.rmtree(self._ray_tmp_root, ignore_errors=True)
        if timeout:
            for h in list(self.log.handlers):
                h.close()
                self.log.removeHandler(h)

    def _client(self):
        from kubernetes import client

        return client.CoreV1Api(self.cp.api_client())

    def _secret(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data, decoded; ``None`` when it does not exist (after waiting 10 s for it, as a kubelet
        retries a container whose Secret is missing)."""
        import base64

        from kubernetes.client.rest import ApiException

        deadline = time.monotonic() + 10
        while True:
            try:
                data = self._client().read_namespaced_secret(name, namespace).data or {}
                return {key: base64.b64decode(value).decode() for key, value in data.items()}
            except ApiException as e:
                if e.status != 404:
                    raise
                if time.monotonic() > deadline:
                    return None
            time.sleep(0.5)

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
            labels = dict(node.metadata.labels or {})
            chips = int(str((node.status.capacity or {}).get(TPU_RESOURCE, "0")))
            info = self._nodes[node.metadata.name] = {
                "ip": ip, "cidr": node.spec.pod_cidr or "10.200.0.0/24", "next": 2,
                "host_processes": labels.get(LABEL_HOST_PROCESSES) == "true",
                "facts": NodeFacts(ip=ip, labels=labels, tpu_chips=chips)}
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

    def _start_host_pod(self, pod, info: dict[str, Any]) -> None:
        """Run the pod's containers here (in a network of its own); a thread starts them and reports
        the pod Running + Ready once its probe passes."""
        uid = pod.metadata.uid
        with self._nodes_lock:
            if uid in self._host_pods:
                return
            self._host_pods[uid] = None  # type: ignore[assignment]  # claimed: being set up
        log_path = self.cp.logs_dir / f"pod-{pod.metadata.namespace}-{pod.metadata.name}.log"
        try:
            sandbox = None
            if self.network is not None:
                spec = pod.spec
                names = ([f"{spec.hostname}.{spec.subdomain}.{pod.metadata.namespace}.svc.cluster.local",
                          spec.hostname] if spec.hostname and spec.subdomain else [spec.hostname or pod.metadata.name])
                sandbox = self.network.add_pod(f"{pod.metadata.namespace}/{pod.metadata.name}",
                                               pod.metadata.namespace, names)
            host_pod = HostProcessPod(pod, info["facts"], log_path, self._ray_tmp_root / uid[:8], sandbox,
                                      self._secret)
        except BaseException:
            with self._nodes_lock:
                self._host_pods.pop(uid, None)
            raise
        with self._nodes_lock:
            self._host_pods[uid] = host_pod
        self._record("started host processes", f"{host_pod.key} at {host_pod.pod_ip} (log {log_path.name})")
        threading.Thread(target=self._report_when_ready, args=(pod, info, host_pod),
                         name=f"virtual-kubelet-probe-{pod.metadata.name}", daemon=True).start()

    def _report_when_ready(self, pod, info: dict[str, Any], host_pod: HostProcessPod) -> None:
        if not self._start_first_container(host_pod):
            self._never_ready(host_pod)
            return
        if self._wait_ready(host_pod):
            if not self._patch_status(pod, self._running_status(pod, info, pod_ip=host_pod.pod_ip)):
                return
            self._record("running (host processes)", f"{host_pod.key} on {pod.spec.node_name}")
        elif host_pod.exited() is None:  # stopping, or no probe pass in 300 s
            self._never_ready(host_pod)
            return
        self._keep_running(pod, info, host_pod)

    def _never_ready(self, host_pod: HostProcessPod) -> None:
        if not self._stop.is_set() and self._host_pods.get(host_pod.uid) is host_pod:
            self.errors.append(f"{host_pod.key} never became ready (exit {host_pod.exited()}): {host_pod.log_tail()}")

    def _keep_running(self, pod, info: dict[str, Any], host_pod: HostProcessPod) -> None:
        """restartPolicy Always: a container that exits (e.g. ``ray start`` giving up after its 30 s wait for the
        GCS on a busy machine) is started again after a kubelet's back-off (10 s, doubling, at most 300 s), and the
        pod is not ready until its probe passes again."""
        while not self._stop.wait(1.0) and self._host_pods.get(host_pod.uid) is host_pod:
            exit_code = host_pod.exited()
            if exit_code is None:
                continue
            if not self._patch_status(pod, self._running_status(pod, info, host_pod.pod_ip, host_pod.restarts + 1,
                                                                exit_code)):
                return
            if self._stop.wait(min(10.0 * 2 ** host_pod.restarts, 300.0)) or not self._take_start_slot():
                return
            if not host_pod.restart():
                self._give_back_start_slot()
                return
            self._record("restarted container", f"{host_pod.key} (exit {exit_code}, restart {host_pod.restarts})")
            if self._wait_ready(host_pod) and not self._patch_status(
                    pod, self._running_status(pod, info, host_pod.pod_ip, host_pod.restarts)):
                return

    def _patch_status(self, pod, status: dict[str, Any]) -> bool:
        """Write the pod's status; ``False`` when the pod is gone."""
        from kubernetes.client.rest import ApiException

        try:
            self._client().patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, status,
                                                       _content_type="application/strategic-merge-patch+json")
            return True
        except ApiException as e:
            if e.status != 404:
                raise
            return False

    def _stop_host_pod(self, uid: str) -> None:
        with self._nodes_lock:
            host_pod = self._host_pods.get(uid)
            if host_pod is None:
                return  # not ours, or still being set up (its creator finishes first)
            del self._host_pods[uid]
        host_pod.stop()
        if host_pod.sandbox is not None and self.network is not None:
            self.network.remove_pod(host_pod.sandbox)
        self._record("stopped host processes", host_pod.key)

    # ---------------------------------------------------------------- DNS
    def _dns_loop(self) -> None:
        """The cluster DNS: EndpointSlices (made by the real controller manager) -> the pods' hosts files."""
        from kubernetes import client

        api = self.cp.api_client()
        discovery = client.DiscoveryV1Api(api)

        def on_event(kind: str, endpoint_slice) -> None:
            uid = endpoint_slice.metadata.uid
            if kind == "DELETED":
                self._endpoint_slices.pop(uid, None)
            else:
                self._endpoint_slices[uid] = api.sanitize_for_serialization(endpoint_slice)
            assert self.network is not None
            self.network.set_records(dns_records(list(self._endpoint_slices.values())))

        self._watch(discovery.list_endpoint_slice_for_all_namespaces, on_event, threading.Event())
