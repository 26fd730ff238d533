"""A Service's virtual address for host processes, as kube-proxy's userspace mode served it: one
listener per Service port on the node's address, each new connection sent to a ready endpoint
(EndpointSlices read from the API server at connect time), bytes copied both ways.

The host-side istiod reaches the control plane's ClusterIP Service this way (its Service DNS name
resolves to the node address in istiod's own hosts file: istiod.py), so a new connection goes to a
ready replica only, and an established one lives as long as that replica's socket (a killed
replica resets it; istiod reconnects and lands on a ready one), as with kube-proxy.

Not done: the ClusterIP itself (no iptables on the host: the machine is shared), session affinity,
UDP, traffic from pods (they reach ClusterIPs through their sidecars).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from .cluster import LocalCluster

Obj = dict[str, Any]
MAX_CONNECTIONS = 64  # per listener; more are refused (closed at once)
CONNECT_TIMEOUT_S = 3.0
CHUNK = 64 * 1024


@dataclass
class ServiceProxy:
    cluster: LocalCluster
    namespace: str
    service: str
    bind_ip: str
    _listeners: list[socket.socket] = field(default_factory=list)
    _conns: set[socket.socket] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        svc = self.cluster.get(f"/api/v1/namespaces/{self.namespace}/services/{self.service}")
        if svc is None:
            raise RuntimeError(f"no Service {self.namespace}/{self.service}")
        for port in svc["spec"]["ports"]:
            listener = socket.create_server((self.bind_ip, int(port["port"])), backlog=64)
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(listener, port.get("name", "")), daemon=True,
                             name=f"svc-{self.service}-{port['port']}").start()

    def endpoint(self, port_name: str) -> tuple[str, int] | None:
        """A ready endpoint's address and port for the Service port named `port_name`."""
        slices = self.cluster.get(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
                                  f"?labelSelector=kubernetes.io%2Fservice-name%3D{self.service}") or {}
        choices = []
        for s in slices.get("items", []):
            port = next((p["port"] for p in s.get("ports") or [] if p.get("name", "") == port_name), None)
            for endpoint in s.get("endpoints") or [] if port is not None else []:
                if (endpoint.get("conditions") or {}).get("ready"):
                    choices += [(a, int(port)) for a in endpoint["addresses"]]  # type: ignore[arg-type]
        return random.choice(choices) if choices else None

    def _accept(self, listener: socket.socket, port_name: str) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, port_name), daemon=True).start()

    def _serve(self, client: socket.socket, port_name: str) -> None:
        upstream = None
        with contextlib.suppress(Exception):
            target = self.endpoint(port_name)
            with self._lock:
                full = len(self._conns) >= 2 * MAX_CONNECTIONS * len(self._listeners)
            if target is not None and not full:
                upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
                upstream.settimeout(None)
        if upstream is None:
            client.close()  # no ready endpoint: refused, as a Service without endpoints
            return
        with self._lock:
            self._conns |= {client, upstream}
        t = threading.Thread(target=self._copy, args=(upstream, client), daemon=True)
        t.start()
        self._copy(client, upstream)
        t.join()
        with self._lock:
            self._conns -= {client, upstream}
        client.close()
        upstream.close()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(CHUNK):
                dst.sendall(data)
        # EOF or reset on one side: both directions end (a reset replica ends istiod's stream).
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        for listener in self._listeners:
            # shutdown first: close() alone leaves a socket another thread is blocked in accept()
            # on listening (Linux), holding node_ip:port for a later node that reuses the subnet.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
