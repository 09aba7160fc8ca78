"""What a local cluster's head says about its nodes: the GCS's ALIVE raylets, and whether the dashboard answers.

Used by the supervisor (:mod:`airflow_provider_raytpu.backends.local.supervisor`); Ray is
imported only once the GCS port is open.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any

from airflow_provider_raytpu.backends.local.plan import LABEL_SLICE_NAME
from airflow_provider_raytpu.backends.local.process import port_open

log = logging.getLogger(__name__)


class Gcs:
    """One ``GcsClient`` to the head's GCS, made when the GCS first answers and dropped with the head."""

    def __init__(self) -> None:
        self.client: Any = None

    def forget(self) -> None:
        """The GCS went with the head: the next question opens a new client."""
        self.client = None

    def alive_nodes(self, port: int) -> dict[int, tuple[str, str]] | None:
        """ALIVE nodes in the GCS on ``port``: node manager port -> (node id, slice name label).

        ``None`` if the GCS does not answer.
        """
        address = f"127.0.0.1:{port}"
        if self.client is None:
            if not port_open(port):
                return None
            from airflow_provider_raytpu.workloads.ray_compat import GcsClient

            try:
                self.client = GcsClient(address=address)
            except Exception as exc:  # noqa: BLE001 - any failure means "not reachable yet"
                log.info("GCS at %s not reachable yet: %s", address, exc)
                return None
        try:
            infos = self.client.get_all_node_info(timeout=2)
        except Exception as exc:  # noqa: BLE001
            log.info("GCS query failed: %s", exc)
            return None
        return {
            info.node_manager_port: (info.node_id.hex(), info.labels.get(LABEL_SLICE_NAME, ""))
            for info in infos.values()
            if info.state == 0
        }

    def drain(self, node_ids: list[str]) -> None:
        """Mark nodes dead in the GCS (no-op for nodes it already knows are dead, or without a client)."""
        if not node_ids or self.client is None:
            return
        try:
            self.client.drain_nodes([bytes.fromhex(i) for i in node_ids], timeout=5)
        except Exception as exc:  # noqa: BLE001 - the health checks will get there anyway
            log.info("could not drain %s in the GCS: %s", node_ids, exc)


def dashboard_ready(port: int) -> bool:
    """Whether the dashboard on ``port`` answers its health check and the Jobs API."""
    base = f"http://127.0.0.1:{port}"
    for path in ("/api/gcs_healthz", "/api/jobs/"):
        try:
            with urllib.request.urlopen(base + path, timeout=2) as answer:
                if answer.status != 200:
                    return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
    return True
