"""Who talks to the control plane (controlplane.py): the static token file of its identities (admin and one
per component), their kubeconfigs (CA embedded), admin API clients, ServiceAccount tokens through the
TokenRequest API, and the audit policy that records what they did.

A mixin: the control plane owns the identities, the work dir, the PKI and the server URL.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from tests.controlplane.components import AUDIT_POLICY


class Credentials:
    """The control plane's ``_write_auth_files``, ``kubeconfig_dict``, ``api_client`` and ``token_for``."""

    identities: dict[str, Any]
    workdir: Path
    pki: dict[str, Path]
    server: str
    admin_token: str
    token_file: Path
    kubeconfig_path: Path
    audit_policy_path: Path

    def _write_auth_files(self) -> None:
        lines = []
        for ident in self.identities.values():
            groups = ",".join(ident.groups)
            lines.append(f'{ident.token},{ident.user},{ident.user},"{groups}"' if groups
                         else f"{ident.token},{ident.user},{ident.user}")
        self.token_file = self.workdir / "tokens.csv"
        self.token_file.write_text("\n".join(lines) + "\n")
        self.token_file.chmod(0o600)
        for name in self.identities:
            path = self.workdir / f"{name}.kubeconfig"
            path.write_text(json.dumps(self.kubeconfig_dict(token=self.identities[name].token, user=name), indent=1))
            path.chmod(0o600)
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.audit_policy_path.write_text(json.dumps(AUDIT_POLICY))

    def kubeconfig_dict(self, *, token: str | None = None, user: str = "admin",
                        namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig as a dict (CA embedded), e.g. for an Airflow
        cncf-kubernetes connection's ``kube_config`` extra. Admin by default."""
        ca_data = base64.b64encode(self.pki["ca_crt"].read_bytes()).decode() if self.pki else None
        cluster: dict[str, Any] = {"server": self.server}
        if ca_data:
            cluster["certificate-authority-data"] = ca_data
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "raytpu-test", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "raytpu-test", "context": {"cluster": "raytpu-test", "user": user,
                                                              "namespace": namespace}}],
            "current-context": "raytpu-test",
            "preferences": {},
        }

    def api_client(self, token: str | None = None):
        """A new ``kubernetes.client.ApiClient`` (admin unless ``token``)."""
        from kubernetes import config

        return config.new_client_from_config_dict(self.kubeconfig_dict(token=token))

    def token_for(self, serviceaccount: str, namespace: str = "default", *, create: bool = True,
                  expiration_seconds: int = 3600, audiences: list[str] | None = None,
                  cluster_role: str | None = None) -> str:
        """A bearer token of ServiceAccount ``namespace/serviceaccount`` (TokenRequest API).

        ``create`` makes the ServiceAccount if missing; ``cluster_role`` (e.g.
        "cluster-admin", "edit", "view") binds it cluster-wide.
        """
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            if create:
                try:
                    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
                        metadata=client.V1ObjectMeta(name=serviceaccount)))
                except ApiException as e:
                    if e.status != 409:
                        raise
            if cluster_role:
                rbac = client.RbacAuthorizationV1Api(api)
                binding = client.V1ClusterRoleBinding(
                    metadata=client.V1ObjectMeta(name=f"{namespace}-{serviceaccount}-{cluster_role}"),
                    role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                                              name=cluster_role),
                    subjects=[client.RbacV1Subject(kind="ServiceAccount", name=serviceaccount,
                                                   namespace=namespace)])
                try:
                    rbac.create_cluster_role_binding(binding)
                except ApiException as e:
                    if e.status != 409:
                        raise
            tr = core.create_namespaced_service_account_token(
                serviceaccount, namespace, client.AuthenticationV1TokenRequest(
                    spec=client.V1TokenRequestSpec(audiences=audiences or [], expiration_seconds=expiration_seconds)))
            return tr.status.token
