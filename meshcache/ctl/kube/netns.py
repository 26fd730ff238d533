"""The test node's pod network: addresses the project creates itself (root, iproute2).

    host: bridge mcbr<X> 10.244.X.1/24 (the node's address; istiod's CA/xDS port listens on it)
      +-- veth mcv<X>p<N> <==> eth0 in network namespace mc-<X>-<N>: 10.244.X.N/24, default via .1

A private /24 per node, picked unused at start (X random), so two clusters on one machine never
share addresses. Pod-to-pod traffic is bridged (no IP forwarding on the host); the host reaches
every pod over the bridge. `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for
the processes it starts: each pod gets one naming itself and istiod's Service
(`istiod.istio-system.svc` -> the node address, as cluster DNS would name the ClusterIP).
Loopback addresses cannot be used: EndpointSlice validation refuses them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

POD_CIDR_PARENT = ipaddress.ip_network("10.244.0.0/16")
NETNS_ETC = Path("/etc/netns")


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _used_subnets() -> set[int]:
    """Third octets of the 10.244.X.0/24 networks some interface already has."""
    used = set()
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        for word in line.split():
            if word.startswith("10.244."):
                used.add(int(word.split(".")[2]))
    return used


@dataclass
class PodNetns:
    name: str  # the network namespace
    ip: str
    host_veth: str
    base_hosts: list[str] = field(default_factory=list)  # its own name, the node's fixed names

    def write_hosts(self, extra: list[str] = ()) -> None:  # type: ignore[assignment]
        """The pod's /etc/hosts, rewritten in place: the bind mounts of running processes see it."""
        with open(NETNS_ETC / self.name / "hosts", "w") as f:
            f.write("\n".join([*self.base_hosts, *extra]) + "\n")

    def exec_argv(self, *argv: str) -> list[str]:
        """argv run inside the namespace (with its /etc/hosts)."""
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class NodeNetwork:
    index: int  # X in 10.244.X.0/24
    pods: dict[str, PodNetns] = field(default_factory=dict)
    _next: int = 2

    @property
    def bridge(self) -> str:
        return f"mcbr{self.index}"

    @property
    def cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def node_ip(self) -> str:
        return f"10.244.{self.index}.1"

    @classmethod
    def create(cls) -> NodeNetwork:
        for _ in range(8):  # another node made at the same moment may pick the same X: pick again
            free = sorted(set(range(1, 255)) - _used_subnets())
            if not free:
                raise NetworkError("no free 10.244.X.0/24 for a test node")
            net = cls(random.choice(free))
            if _ip("link", "add", net.bridge, "type", "bridge", check=False).returncode == 0:
                break
        else:
            raise NetworkError("could not create a test node bridge (mcbr<X>) after 8 tries")
        try:
            _ip("addr", "add", f"{net.node_ip}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except BaseException:
            _ip("link", "del", net.bridge, check=False)
            raise
        return net

    def add_pod(self, key: str, hostname: str, hosts: dict[str, str]) -> PodNetns:
        """A network namespace with the next address and its /etc/hosts: its own `hostname` and
        `hosts` (name -> address)."""
        n = self._next
        if n > 254:
            raise NetworkError(f"node network {self.cidr} is full")
        self._next += 1
        pod = PodNetns(name=f"mc-{self.index}-{n}", ip=f"10.244.{self.index}.{n}", host_veth=f"mcv{self.index}p{n}")
        self.pods[key] = pod
        _ip("netns", "add", pod.name)
        _ip("link", "add", pod.host_veth, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
        _ip("link", "set", pod.host_veth, "master", self.bridge, "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{pod.ip}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("route", "add", "default", "via", self.node_ip)):
            _ip("-n", pod.name, *args)
        (NETNS_ETC / pod.name).mkdir(parents=True, exist_ok=True)
        pod.base_hosts = ["127.0.0.1 localhost", f"{pod.ip} {hostname}",
                          *(f"{ip} {name}" for name, ip in hosts.items())]
        pod.write_hosts()
        return pod

    def remove_pod(self, key: str) -> None:
        pod = self.pods.pop(key, None)
        if pod is None:
            return
        _ip("netns", "del", pod.name, check=False)  # its eth0 goes with it, and the host end
        _ip("link", "del", pod.host_veth, check=False)
        shutil.rmtree(NETNS_ETC / pod.name, ignore_errors=True)

    def delete(self) -> None:
        for key in list(self.pods):
            with contextlib.suppress(Exception):
                self.remove_pod(key)
        _ip("link", "del", self.bridge, check=False)
