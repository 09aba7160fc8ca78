"""What each control-plane process is started with: its command line, from the control plane's
ports, work dir and PKI. All listen on 127.0.0.1 and run without leader election."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.controlplane.controlplane import ControlPlane

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
#: The API server's audit policy: who did what (Metadata: no bodies) for the identities the provider's
#: connections use (the admin, and the ServiceAccounts of ``Connections.as_role``); nothing for the
#: control plane's own components. Read by ``tests/controlplane/audit.py``.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "Metadata", "users": ["raytpu-admin"]},
        {"level": "None"},
    ],
}


def etcd_argv(cp: ControlPlane) -> list[str]:
    c, p = cp.etcd_port, cp.etcd_peer_port
    return [
        str(cp.bin_dir / "etcd"),
        "--name=raytpu-test",
        f"--data-dir={cp.workdir / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{c}",
        f"--advertise-client-urls=http://127.0.0.1:{c}",
        f"--listen-peer-urls=http://127.0.0.1:{p}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{p}",
        f"--initial-cluster=raytpu-test=http://127.0.0.1:{p}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync",  # test data: durability not needed, much faster
        "--log-level=warn",
    ]


def apiserver_argv(cp: ControlPlane) -> list[str]:
    pki = cp.pki
    return [
        str(cp.bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{cp.etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={cp.apiserver_port}",
        f"--tls-cert-file={pki['apiserver_crt']}",
        f"--tls-private-key-file={pki['apiserver_key']}",
        f"--client-ca-file={pki['ca_crt']}",
        f"--token-auth-file={cp.token_file}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki['sa_pub']}",
        f"--service-account-signing-key-file={pki['sa_key']}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        # 127.0.0.1 may not be an endpoint of the `kubernetes` service.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        f"--cert-dir={cp.workdir / 'apiserver-certs'}",
        f"--audit-policy-file={cp.audit_policy_path}",
        f"--audit-log-path={cp.audit_log_path}",
        "--audit-log-format=json",
        "--v=1",
    ]


def scheduler_argv(cp: ControlPlane) -> list[str]:
    kc = str(cp.workdir / "scheduler.kubeconfig")
    return [
        str(cp.bin_dir / "kube-scheduler"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={cp.scheduler_port}",
        f"--cert-dir={cp.workdir / 'scheduler-certs'}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(cp: ControlPlane) -> list[str]:
    kc = str(cp.workdir / "controller-manager.kubeconfig")
    pki = cp.pki
    return [
        str(cp.bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={cp.kcm_port}",
        f"--cert-dir={cp.workdir / 'kcm-certs'}",
        # Everything on by default (1.37 has no cloud controllers left in
        # KCM), minus node IPAM: the nodes come with their podCIDR.
        "--controllers=*,-node-ipam-controller",
        f"--service-account-private-key-file={pki['sa_key']}",
        f"--root-ca-file={pki['ca_crt']}",
        f"--cluster-signing-cert-file={pki['ca_crt']}",
        f"--cluster-signing-key-file={pki['ca_key']}",
        "--use-service-account-credentials=false",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--profiling=false",
        "--v=1",
    ]


def operator_argv(cp: ControlPlane) -> list[str]:
    return [
        str(cp.bin_dir / "kuberay-operator"),
        "--feature-gates=RayMultiHostIndexing=true",
        # Dashboards and Serve proxies through the API server (services/proxy, pods/proxy): the
        # operator runs outside any pod network, and the API server can reach host-process pods.
        "--use-kubernetes-proxy",
        "--enable-leader-election=false",
        f"--metrics-addr=127.0.0.1:{cp.operator_metrics_port}",
        f"--health-probe-bind-address=127.0.0.1:{cp.operator_probe_port}",
        "--log-stdout-encoder=console",
        *cp.operator_args,
    ]


def operator_env(cp: ControlPlane) -> dict[str, str]:
    """The operator runs outside the cluster, with its own kubeconfig."""
    return {**os.environ, "KUBECONFIG": str(cp.workdir / "kuberay-operator.kubeconfig")}
