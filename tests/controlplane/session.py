"""The session fixture of the real control plane (controlplane.py): import :func:`k8s_control_plane` into a
conftest; :func:`control_plane_session` is its body, for a fixture of other options."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

from tests.controlplane.controlplane import ControlPlane
from tests.support.processes import BinariesNotBuilt, find_bin_dir


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
        if cp.pod_network is None:
            print(f"\n[k8s] pods get no network of their own ({cp.pod_network_problem}): single-head mode, "
                  "host-process pods share this machine's address; tests that need more real pods skip",
                  file=sys.stderr)
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
