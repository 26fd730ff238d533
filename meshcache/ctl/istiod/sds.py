"""The SDS server a sidecar's `sds-grpc` cluster reaches: pilot-agent's role in a pod.

istiod's generated clusters and listeners take their certificates by SDS from the cluster
`sds-grpc`: `default` (the workload certificate and key) and `ROOTCA` (the trust bundle), with
`initial_fetch_timeout: 0`, so without this server they wait forever. pilot-agent gets them from
istiod's CA; here they come from the mesh CA (meshcache/ctl/pki.py: ECDSA P-256, SPIFFE URI SAN
`spiffe://cluster.local/ns/NS/sa/SA`), as files this server re-reads when they change.

One process per sidecar on a Unix socket, as pilot-agent serves its Envoy:
    python -m meshcache.ctl.istiod.sds --socket S --cert C --key K --ca CA
State of the world per stream: every request naming secrets gets them (a version per file
generation); an ACK waits for a change (certificate files re-issued: polled once a second).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
from google.protobuf import any_pb2

log = logging.getLogger("meshcache.sds")
SECRET_TYPE_URL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
WORKLOAD = "default"  # pilot-agent's names (pkg/security: WorkloadKeyCertResourceName, RootCertReqResourceName)
ROOT = "ROOTCA"
POLL_S = 1.0
MAX_STREAMS = 16  # one Envoy: a stream per secret subscription, a few at most


class Files:
    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self.cert, self.key, self.ca = cert, key, ca

    def read(self) -> tuple[str, dict[str, secret_pb2.Secret]]:
        cert, key, ca = self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        version = hashlib.sha256(cert + key + ca).hexdigest()[:16]
        return version, {
            WORKLOAD: secret_pb2.Secret(name=WORKLOAD, tls_certificate=common_pb2.TlsCertificate(
                certificate_chain=_bytes(cert), private_key=_bytes(key))),
            ROOT: secret_pb2.Secret(name=ROOT, validation_context=common_pb2.CertificateValidationContext(
                trusted_ca=_bytes(ca))),
        }


def _bytes(data: bytes) -> base_pb2.DataSource:
    return base_pb2.DataSource(inline_bytes=data)


class SdsServicer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self, files: Files) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._nonce = 0

    def _next_nonce(self) -> str:
        with self._lock:
            self._nonce += 1
            return str(self._nonce)

    def StreamSecrets(self, request_iterator: Iterator[discovery_pb2.DiscoveryRequest],  # noqa: N802 - gRPC name
                      context: grpc.ServicerContext) -> Iterator[discovery_pb2.DiscoveryResponse]:
        requests: list[discovery_pb2.DiscoveryRequest] = []
        cond = threading.Condition()

        def read_requests() -> None:
            try:
                for req in request_iterator:
                    with cond:
                        requests.append(req)
                        cond.notify()
            except grpc.RpcError:
                pass  # the stream was reset: end it like a closed one
            finally:
                with cond:
                    requests.append(None)  # type: ignore[arg-type]
                    cond.notify()

        threading.Thread(target=read_requests, daemon=True).start()
        names: list[str] = []
        sent_version = ""
        while context.is_active():
            with cond:
                cond.wait_for(lambda: bool(requests), timeout=POLL_S)
                pending = list(requests)
                requests.clear()
            if any(r is None for r in pending):
                return
            for req in pending:
                if req.error_detail.message:
                    log.warning("secret NACKed: %s", req.error_detail.message)
                if list(req.resource_names) != names or not req.response_nonce:
                    names, sent_version = list(req.resource_names), ""
            try:
                version, secrets = self.files.read()
            except OSError as exc:
                log.warning("cannot read certificates: %s", exc)
                continue
            if names and version != sent_version:
                resources = []
                for name in names:
                    if name in secrets:
                        packed = any_pb2.Any()
                        packed.Pack(secrets[name])
                        resources.append(packed)
                yield discovery_pb2.DiscoveryResponse(version_info=version, resources=resources,
                                                      type_url=SECRET_TYPE_URL, nonce=self._next_nonce())
                sent_version = version


def serve(socket_path: Path, files: Files) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STREAMS), maximum_concurrent_rpcs=MAX_STREAMS)
    sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(SdsServicer(files), server)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", type=Path, required=True)
    p.add_argument("--cert", type=Path, required=True)
    p.add_argument("--key", type=Path, required=True)
    p.add_argument("--ca", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    files = Files(args.cert, args.key, args.ca)
    files.read()  # fail now, not on the first request
    server = serve(args.socket, files)
    log.info("SDS on unix:%s", args.socket)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
