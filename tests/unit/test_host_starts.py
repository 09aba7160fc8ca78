"""The local backend starts a cluster's hosts a few at a time: the next one when a starting host's raylet is ALIVE.

A raylet gives its dashboard agent 15 s to write its port files and then aborts (Ray issue 65983). Four hosts of
two emulated slices started together on a busy 2-core machine all missed it, three times in a row, because their
retries came together too (tests/ray/local_backend/test_multislice.py's cluster, seen in the CI's Ray tier).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_raytpu.backends.local import nodes
from airflow_provider_raytpu.backends.local.nodes import Node, hosts_to_start
from airflow_provider_raytpu.backends.local.plan import NodeSpec


def hosts(keys: list[str], tmp_path: Path) -> list[Node]:
    return [Node(NodeSpec(key=key, num_cpus=1), tmp_path / f"{key}.log") for key in keys]


def start(node: Node) -> None:
    """A started node: its process ran (a real one, already ended); not ready until its raylet is ALIVE."""
    node.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    node.proc.wait()


@pytest.mark.parametrize("parallel", [1, 2])
def test_hosts_start_as_starting_ones_become_ready(parallel: int, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "PARALLEL_STARTS", parallel)
    first, second = hosts(["s0h0", "s0h1"], tmp_path), hosts(["s1h0", "s1h1"], tmp_path)
    cluster = first + second
    due = hosts_to_start(first, cluster)
    assert [n.spec.key for n in due] == ["s0h0", "s0h1"][:parallel]
    for node in due:
        start(node)
    assert hosts_to_start(second, cluster) == [], "the other slice waits while as many hosts are starting"
    due[0].ready = True
    started = []
    for slice_hosts in (first, second):  # as the supervisor's pass goes: each slice's due hosts start in turn
        for node in hosts_to_start(slice_hosts, cluster):
            start(node)
            started.append(node.spec.key)
    assert started == (["s1h0"] if parallel == 2 else ["s0h1"])


def test_a_slice_whose_hosts_all_run_starts_nothing(tmp_path: Path) -> None:
    slice_hosts = hosts(["s0h0", "s0h1"], tmp_path)
    for node in slice_hosts:
        start(node)
        node.ready = True
    assert hosts_to_start(slice_hosts, slice_hosts) == []

