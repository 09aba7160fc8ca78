"""Nodes that look like GKE node pools (labels, taints, TPU capacity), for the virtual kubelet to serve.

A TPU pool's nodes carry ``cloud.google.com/gke-tpu-accelerator`` / ``-gke-tpu-topology``, the
``google.com/tpu`` capacity (4 chips per node by default) and the ``google.com/tpu=present:NoSchedule``
taint; a spot pool also ``cloud.google.com/gke-spot`` and its taint. Every node is labelled
:data:`LABEL_VIRTUAL`, the label the virtual kubelet serves.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from airflow_provider_raytpu.gke_tpu import HOST_MACHINES, MACHINE_TYPES, MachineType
from airflow_provider_raytpu.tpu import GENERATIONS
from tests.controlplane.hostpods import LABEL_HOST_PROCESSES, host_address
from tests.support.processes import ControlPlaneError

# GKE node labels and taints.
LABEL_TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
LABEL_TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
LABEL_NODEPOOL = "cloud.google.com/gke-nodepool"
LABEL_SPOT = "cloud.google.com/gke-spot"
TPU_RESOURCE = "google.com/tpu"
# Marks the nodes this harness owns (the virtual kubelet serves only these).
LABEL_VIRTUAL = "raytpu.test/virtual-kubelet"


def tpu_machine_type(accelerator_label: str, chips_per_node: int) -> MachineType:
    """The GKE machine type of a TPU node: the provider's table of what GKE offers (its size is the node's)."""
    generation = next(g.name for g in GENERATIONS.values() if g.gke_accelerator == accelerator_label)
    return MACHINE_TYPES[HOST_MACHINES[generation][chips_per_node]]


def _slice_hosts(topology: str, chips_per_node: int) -> int:
    chips = 1
    for dim in topology.split("x"):
        chips *= int(dim)
    return max(1, chips // chips_per_node)


class GkeNodePools:
    """Creates and deletes the fake GKE nodes of one control plane.

    :param api_client: makes an admin ``kubernetes.client.ApiClient``.
    :param diagnostics: text to add when nodes do not become schedulable (a component's log tail).
    :param pods_have_own_network: whether host-process pods get a network namespace each (else
        they share this machine's address, so one host-process CPU node is all there can be).
    """

    def __init__(self, api_client: Callable[[], Any], diagnostics: Callable[[], str],
                 pods_have_own_network: Callable[[], bool] = lambda: False) -> None:
        self._api_client = api_client
        self._diagnostics = diagnostics
        self._pods_have_own_network = pods_have_own_network
        self._lock = threading.Lock()
        self._node_seq = 0
        self._pool_sizes: dict[str, int] = {}

    def add(self, name: str, *, cpu_nodes: int | None = None, tpu: str | None = None,
            topology: str | None = None, num_nodes: int | None = None,
            chips_per_node: int = 4, spot: bool = False, cpu: str | None = None,
            memory: str | None = None, pods: str = "110", labels: dict[str, str] | None = None,
            zone: str = "us-central2-b", wait_ready: bool = True,
            host_processes: bool = False, timeout: float = 30.0) -> list[str]:
        """Create Nodes that look like a GKE node pool; return their names.

        CPU pool: ``add("cpu", cpu_nodes=1)``. TPU pool:
        ``add("v6e", tpu="tpu-v6e-slice", topology="4x4", num_nodes=8)``
        (``num_nodes`` defaults to one slice: chips in topology / chips_per_node).
        Calling it again with the same ``name`` adds nodes to that pool
        (``gke-<name>-<index>``), e.g. to replace a preempted node.
        With ``wait_ready`` waits until the node lifecycle controller has
        removed the ``node.kubernetes.io/not-ready`` taint. With ``host_processes`` the
        pods' containers really run, as processes here (tests/controlplane/hostpods.py), each pod in a
        network namespace of its own; without pod networks (no CAP_NET_ADMIN) only one CPU
        node may have it, and its InternalIP is this machine's address, which its pods share.
        """
        from kubernetes import client

        if (cpu_nodes is None) == (tpu is None):
            raise ValueError("give exactly one of cpu_nodes= or tpu=")
        if tpu is not None:
            if not topology:
                raise ValueError("a TPU node pool needs topology=, e.g. '4x4'")
            if num_nodes is None:
                num_nodes = _slice_hosts(topology, chips_per_node)
        else:
            num_nodes = cpu_nodes
        assert num_nodes is not None
        shared_address = host_processes and not self._pods_have_own_network()
        if shared_address and (tpu is not None or num_nodes != 1):
            raise ValueError("without pod networks (CAP_NET_ADMIN), host_processes= is for one CPU node: "
                             "its pods' ports are this machine's")

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
        capacity = {"cpu": cpu or "8", "memory": memory or "32Gi", "pods": pods, "ephemeral-storage": "100Gi"}
        if tpu is not None:  # a TPU node is as big as its machine type, unless told otherwise
            machine = tpu_machine_type(tpu, chips_per_node)
            capacity.update(cpu=cpu or str(machine.vcpus), memory=memory or f"{machine.memory_gb}G")
            base_labels[LABEL_TPU_ACCELERATOR] = tpu
            base_labels[LABEL_TPU_TOPOLOGY] = topology or ""
            base_labels["node.kubernetes.io/instance-type"] = machine.name
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
        with self._api_client() as api:
            core = client.CoreV1Api(api)
            for _ in range(num_nodes):
                with self._lock:
                    self._node_seq += 1
                    seq = self._node_seq
                    index = self._pool_sizes.get(name, 0)  # adding to a pool again scales it up
                    self._pool_sizes[name] = index + 1
                node_name = f"gke-{name}-{index}"
                node_ip = host_address() if shared_address else f"10.128.{seq // 250}.{seq % 250 + 2}"
                node = _node(node_name, seq, node_ip, zone, {**base_labels, "kubernetes.io/hostname": node_name},
                             taints, capacity)
                core.create_node(node)  # the virtual kubelet sees it and takes its Lease
                names.append(node_name)
            if wait_ready:
                self._wait_schedulable(core, names, timeout)
        return names

    def _wait_schedulable(self, core, names: list[str], timeout: float) -> None:
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
                                        f"kube-controller-manager log:\n{self._diagnostics()}")
            time.sleep(0.2)

    def delete_pool(self, name: str) -> list[str]:
        """Delete every Node of pool ``name``; return their names."""
        from kubernetes import client

        with self._api_client() as api:
            nodes = client.CoreV1Api(api).list_node(label_selector=f"{LABEL_NODEPOOL}={name}").items
        for n in nodes:
            self.delete_node(n.metadata.name)
        return [n.metadata.name for n in nodes]

    def delete_node(self, name: str) -> None:
        """Delete a Node (like a GKE preemption / node-pool scale-down); the
        virtual kubelet fails and deletes its pods."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        with self._api_client() as api:
            try:
                client.CoreV1Api(api).delete_node(name)
            except ApiException as e:
                if e.status != 404:
                    raise


def _node(name: str, seq: int, ip: str, zone: str, labels: dict[str, str], taints: list, capacity: dict[str, str]):
    """A Ready ``V1Node`` with its own podCIDR and GKE-like system info."""
    from kubernetes import client

    now = dt.datetime.now(dt.UTC)
    cidr = f"10.{64 + seq // 256}.{seq % 256}.0/24"
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1NodeSpec(taints=taints or None, pod_cidr=cidr, pod_cidrs=[cidr],
                               provider_id=f"gce://raytpu-test/{zone}/{name}"),
        status=client.V1NodeStatus(
            capacity=capacity, allocatable=capacity,
            addresses=[client.V1NodeAddress(type="InternalIP", address=ip),
                       client.V1NodeAddress(type="Hostname", address=name)],
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
