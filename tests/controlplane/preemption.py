"""A TPU host preempted mid-training: its Node deleted once the run has committed a checkpoint at step 10
or later, a replacement node added to the pool, Ray's node list recorded before and after."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from example_dags.demo.fake_gcs import FakeGcsServer
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.example_runs import BUCKET, V4, cluster_pods, committed_steps, ray_nodes
from tests.controlplane.support import HOST_INDEX, list_pods, pod_ready, wait_for


class FaultThread:
    """A fault a test injects from a thread while a DAG runs: :meth:`start`, then :meth:`join` raises what
    went wrong in it. Subclasses write ``_run``."""

    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        raise NotImplementedError

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as error:  # raised by join, in the test
            self.error = error

    def start(self) -> None:
        self._thread = threading.Thread(target=self._guarded, name=type(self).__name__, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error


@dataclass
class Preemption(FaultThread):
    """A test thread: deletes TPU host 1's Node once the run's checkpoint at step >= 10 is committed,
    adds a replacement node to the pool, and records Ray's node list before and after."""

    cp: ControlPlane
    namespace: str
    gcs: FakeGcsServer
    pool: str
    reference_run: str
    checkpointed: int = -1
    cluster: str = ""
    deleted_node: str = ""
    nodes_before: list[dict[str, Any]] = field(default_factory=list)
    nodes_after: list[dict[str, Any]] = field(default_factory=list)

    def _training_run(self) -> str | None:
        runs = {n.split("/")[1] for n in self.gcs.list_objects(BUCKET, "checkpoints/") if "/orbax/" in n}
        runs.discard(self.reference_run)
        return next(iter(runs), None)

    def _run(self) -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            run = self._training_run()
            if run and committed_steps(self.gcs, f"checkpoints/{run}/") and \
                    committed_steps(self.gcs, f"checkpoints/{run}/")[-1] >= 10:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the second run never committed a checkpoint at step 10")
        self.checkpointed = committed_steps(self.gcs, f"checkpoints/{run}/")[-1]
        workers = [p for p in list_pods(self.cp, self.namespace, "ray.io/node-type=worker")
                   if p["metadata"]["labels"].get("ray.io/group") == "tpu-slices"
                   and p["spec"]["nodeSelector"].get("cloud.google.com/gke-tpu-accelerator") == V4]
        self.cluster = workers[0]["metadata"]["labels"]["ray.io/cluster"]
        self.nodes_before = ray_nodes(self.cp, self.namespace, self.cluster)
        old = {p["metadata"]["uid"] for p in workers}
        host_1 = next(p for p in workers if p["metadata"]["labels"][HOST_INDEX] == "1")
        self.deleted_node = host_1["spec"]["nodeName"]
        self.cp.delete_node(self.deleted_node)  # a preemption: the virtual kubelet fails its pods
        self.cp.add_node_pool(self.pool, tpu=V4, topology="2x2x2", num_nodes=1, host_processes=True)

        def recreated() -> bool:
            pods = [p for p in cluster_pods(self.cp, self.namespace, self.cluster)
                    if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]
            return len(pods) == 2 and all(pod_ready(p) and p["metadata"]["uid"] not in old for p in pods)

        wait_for(recreated, 600, "the slice recreated by KubeRay, both hosts Ready", interval=1)
        self.nodes_after = wait_for(lambda: (n := ray_nodes(self.cp, self.namespace, self.cluster)) and len(n) == 3
                                    and n, 300, "the recreated raylets in Ray's node list", interval=1)
