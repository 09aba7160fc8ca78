"""A network of its own for every host-process pod: one network namespace per pod on a bridge.

Why namespaces and not address aliases on ``lo``: Ray's GCS and raylet listen on the wildcard
address (measured with ray 2.60: ``*:6379``, ``*:<raylet ports>``), and KubeRay starts every
pod with the same fixed ports (GCS 6379, dashboard 8265, dashboard agent 52365, metrics 8080,
Serve 8000). Two Ray pods in one network namespace collide even with an address each; in a
namespace each, as in a real pod, ``0.0.0.0`` means the pod's own address.

:class:`PodNetwork` owns, under names that carry a random tag: a bridge with the gateway address
``10.<n>.0.1/16`` (a /16 no interface here uses), and per pod a network namespace with a veth pair
(the pod end, ``eth0``, holds the pod IP; the host end is on the bridge) and ``/etc/netns/<ns>/``
``hosts`` and ``resolv.conf``, which ``ip netns exec`` mounts over ``/etc`` for the pod's processes.
The host reaches every pod through the bridge (so the API server's service proxy does), pods reach
each other and the gateway, nothing else. :meth:`PodNetwork.set_records` is the cluster DNS: it
rewrites every pod's hosts file in place (same inode: the bind mount sees it).

Creating one needs CAP_NET_ADMIN (root here). :meth:`PodNetwork.create` raises
:class:`PodNetworkUnavailable` with the reason otherwise; the harness then falls back to
single-head mode (host-process pods share this machine's address).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import secrets
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
log = logging.getLogger(__name__)


class PodNetworkUnavailable(RuntimeError):
    """This machine does not let the harness make network namespaces (no CAP_NET_ADMIN, no ``ip``)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise PodNetworkUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _used_networks() -> list[ipaddress.IPv4Network]:
    addresses = json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]")
    return [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for link in addresses for a in link.get("addr_info", [])]


@dataclass
class PodSandbox:
    """One pod's network: its namespace, address and DNS names.

    :param key: ``namespace/name`` of the pod.
    :param netns: the network namespace's name (``ip netns exec <netns> ...``).
    :param ip: the pod IP.
    :param namespace: the pod's Kubernetes namespace (short service names resolve in it).
    :param own_names: names of the pod itself (its hostname, and FQDN under its subdomain).
    """

    key: str
    netns: str
    ip: str
    namespace: str
    own_names: list[str] = field(default_factory=list)

    @property
    def etc(self) -> Path:
        return NETNS_ETC / self.netns

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the pod's network namespace (with its hosts file over /etc/hosts)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Every process in the pod's network namespace."""
        done = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]


class PodNetwork:
    """The bridge and the pods' network namespaces of one control plane.

    :param network: the /16 this harness uses (the gateway is its first address).
    :param tag: 4 hex characters in every name made here (bridge ``rtpu<tag>``).
    """

    def __init__(self, network: ipaddress.IPv4Network, tag: str) -> None:
        self.network = network
        self.tag = tag
        self.bridge = f"rtpu{tag}"
        self.gateway = str(network.network_address + 1)
        self._lock = threading.Lock()
        self._next = 0
        self._sandboxes: dict[str, PodSandbox] = {}
        self._records: dict[str, dict[str, str]] = {}  # namespace ('' = every namespace) -> name -> IP
        self._closed = False

    @classmethod
    def create(cls) -> PodNetwork:
        """Make the bridge on a free 10.x.0.0/16 (10.240 - 10.254).

        :raises PodNetworkUnavailable: no ``ip`` command, or no permission to make links.
        """
        if shutil.which("ip") is None:
            raise PodNetworkUnavailable("the `ip` command (iproute2) is not installed")
        used = _used_networks()
        free = next((n for n in (ipaddress.ip_network(f"10.{o}.0.0/16") for o in range(240, 255))
                     if not any(n.overlaps(u) for u in used)), None)
        if free is None:
            raise PodNetworkUnavailable("no free 10.240-254.0.0/16 network on this machine")
        net = cls(free, secrets.token_hex(2))
        _ip("link", "add", net.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{net.gateway}/16", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except PodNetworkUnavailable:
            _ip("link", "del", net.bridge, check=False)
            raise
        return net

    # ------------------------------------------------------------------ pods
    def add_pod(self, key: str, namespace: str, own_names: list[str]) -> PodSandbox:
        """A network namespace with the next pod IP, its veth on the bridge, and its hosts file.

        :param key: ``namespace/name`` of the pod.
        :param namespace: the pod's namespace.
        :param own_names: the pod's own names (hostname first).
        """
        with self._lock:
            if self._closed:
                raise PodNetworkUnavailable("the pod network is closed")
            self._next += 1
            n = self._next
        ip = str(self.network.network_address + 256 + n)  # 10.x.1.1, 10.x.1.2, ...: never the gateway
        sandbox = PodSandbox(key=key, netns=f"rtpu-{self.tag}-{n}", ip=ip, namespace=namespace,
                             own_names=[*own_names, socket.gethostname()])
        host_end = f"rt{self.tag}v{n}"
        _ip("netns", "add", sandbox.netns)
        try:
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", sandbox.netns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", sandbox.netns, "addr", "add", f"{ip}/16", "dev", "eth0")
            _ip("-n", sandbox.netns, "link", "set", "eth0", "up")
            _ip("-n", sandbox.netns, "link", "set", "lo", "up")
            _ip("-n", sandbox.netns, "route", "add", "default", "via", self.gateway)
            sandbox.etc.mkdir(parents=True, exist_ok=True)
            # No resolver answers inside: names not in the hosts file fail at once.
            (sandbox.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            (sandbox.etc / "hosts").write_text(self._hosts(sandbox))
        except BaseException:
            self._remove(sandbox)
            raise
        with self._lock:
            self._sandboxes[sandbox.netns] = sandbox
        return sandbox

    def remove_pod(self, sandbox: PodSandbox) -> None:
        """Delete the pod's namespace (its veth pair goes with it) and its /etc/netns files."""
        with self._lock:
            self._sandboxes.pop(sandbox.netns, None)
        self._remove(sandbox)

    @staticmethod
    def _remove(sandbox: PodSandbox) -> None:
        _ip("netns", "del", sandbox.netns, check=False)
        shutil.rmtree(sandbox.etc, ignore_errors=True)

    def namespaces(self) -> list[str]:
        """The pods' network namespaces that exist now, of those made here."""
        listed = set(_ip("netns", "list", check=False).stdout.split())
        with self._lock:
            return sorted(name for name in self._sandboxes if name in listed)

    def close(self) -> None:
        """Remove every pod namespace and the bridge, by the names made here."""
        with self._lock:
            self._closed = True
            sandboxes = list(self._sandboxes.values())
            self._sandboxes.clear()
        for sandbox in sandboxes:
            self._remove(sandbox)
        _ip("link", "del", self.bridge, check=False)

    # ------------------------------------------------------------------ DNS
    def set_records(self, records: dict[str, dict[str, str]]) -> None:
        """Replace the cluster DNS: ``{namespace: {name: ip}}`` (namespace ``''``: names every pod
        resolves); rewrite the pods' hosts files whose content changes."""
        with self._lock:
            self._records = {ns: dict(names) for ns, names in records.items()}
            sandboxes = list(self._sandboxes.values())
        for sandbox in sandboxes:
            path = sandbox.etc / "hosts"
            text = self._hosts(sandbox)
            with contextlib.suppress(FileNotFoundError), open(path, "r+") as handle:
                if handle.read() != text:
                    handle.seek(0)
                    handle.write(text)
                    handle.truncate()

    def _hosts(self, sandbox: PodSandbox) -> str:
        """What a kubelet writes (localhost, the pod's own names) plus the cluster DNS names."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{sandbox.ip}\t{' '.join(sandbox.own_names)}", "# cluster DNS (from EndpointSlices)"]
        names = {**self._records.get("", {}), **self._records.get(sandbox.namespace, {})}
        by_ip: dict[str, list[str]] = {}
        for name, ip in sorted(names.items()):
            by_ip.setdefault(ip, []).append(name)
        lines += [f"{ip}\t{' '.join(hosts)}" for ip, hosts in sorted(by_ip.items())]
        return "\n".join(lines) + "\n"
