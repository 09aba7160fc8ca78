"""The cluster DNS of host-process pods, from the EndpointSlices the real controller manager keeps.

A pod on GKE resolves ``<service>.<namespace>.svc.cluster.local`` (kube-dns) to the Service's
ClusterIP, which kube-proxy forwards to a ready endpoint, and a pod with ``hostname`` and
``subdomain`` set to a headless Service resolves as ``<hostname>.<subdomain>.<namespace>.svc...``.
There is no kube-proxy here, so the names resolve straight to an endpoint's pod IP - what a
headless Service gives. :func:`dns_records` computes the names; the virtual kubelet writes them into
every pod's hosts file (tests/controlplane/podnet.py).
"""

from __future__ import annotations

from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
DOMAIN = "svc.cluster.local"


def dns_records(endpoint_slices: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """``{namespace: {name: ip}}``; namespace ``''`` holds the names every pod resolves, a namespace
    the short names only its pods resolve (``<service>``, ``<hostname>.<subdomain>``).

    A Service resolves to its ready endpoint with the lowest address; an endpoint that has a
    hostname also resolves under the Service as its subdomain.

    :param endpoint_slices: EndpointSlices as JSON dicts (``discovery.k8s.io/v1``).
    """
    endpoints: dict[tuple[str, str], list[tuple[str, str | None]]] = {}
    for endpoint_slice in endpoint_slices:
        metadata = endpoint_slice.get("metadata") or {}
        service = (metadata.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if not service or endpoint_slice.get("addressType") != "IPv4":
            continue
        found = endpoints.setdefault((metadata["namespace"], service), [])
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False or not endpoint.get("addresses"):
                continue
            found.append((endpoint["addresses"][0], endpoint.get("hostname")))
    records: dict[str, dict[str, str]] = {"": {}}
    for (namespace, service), found in sorted(endpoints.items()):
        if not found:
            continue
        local = records.setdefault(namespace, {})
        everywhere = records[""]
        first = min(address for address, _ in found)
        for name in (f"{service}.{namespace}.{DOMAIN}", f"{service}.{namespace}.svc", f"{service}.{namespace}"):
            everywhere[name] = first
        local[service] = first
        for address, hostname in found:
            if hostname:
                for name in (f"{hostname}.{service}.{namespace}.{DOMAIN}", f"{hostname}.{service}.{namespace}.svc"):
                    everywhere[name] = address
                local[f"{hostname}.{service}"] = address
    return records
