"""pytest wiring for the real Kubernetes control plane (see README.md).

Another test tree gets the same session fixture with::

    # tests/integration/conftest.py
    from tests.k8s.controlplane import k8s_control_plane  # noqa: F401  (session fixture)
"""

from __future__ import annotations

from tests.k8s.controlplane import k8s_control_plane  # noqa: F401  (session fixture)


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so this directory works alone.
    config.addinivalue_line(
        "markers", "k8s: needs the real Kubernetes control plane binaries (tests/k8s/build_binaries.sh)")
