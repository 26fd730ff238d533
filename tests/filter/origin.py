"""A real origin server for the filter tests: HTTP/1.1 and gRPC on loopback, counting calls.

HTTP `POST` answers are deterministic in the request (JSON with a digest of the body) and can
be shaped by request headers: `x-origin-status`, `x-origin-cache-control`, `x-origin-size`
(body length), `x-origin-etag`, `x-origin-delay` (seconds before answering), `x-origin-header`
(repeatable, `Name: value` added to the answer), `x-origin-fail-first` (a name: the first
request carrying it is answered 500, the later ones normally), `x-origin-chunked` (chunk size: chunked
transfer coding), `x-origin-pace` (seconds between chunks or events), `x-origin-gzip`,
`x-origin-sse` (that many `text/event-stream` events), `x-origin-read` (the answer carries `read`:
what a server reads from the request, `server_reading.read_rest`; a request it cannot read is
answered 400), `x-origin-hold` (a name: the answer waits until `GET /release/<name>`, so a test
keeps a request in flight exactly until what it checks has happened, instead of guessing a
delay; a name stays released). The JSON answer echoes `x-user` and every
`x-traffic-color` line, so an answer served to the wrong client shows. `GET /calls` returns how many POSTs were served.
gRPC: `/inference.GRPCInferenceService/ModelInfer` answers with a protobuf message carrying the
request's model name (field 1) and a digest of the request (field 5 bytes); metadata
`x-origin-grpc-fail` makes it fail with INVALID_ARGUMENT, `x-origin-grpc-code` with that status
(a `grpc.StatusCode` name, e.g. UNAVAILABLE), `x-origin-delay` waits first, `x-origin-hold` as
for HTTP, `x-origin-fail-first` fails the first call carrying that name with UNAVAILABLE.

Like a KServe v2 server, both echo a request id (REST top-level `"id"` string, gRPC field 3) in
the answer, and the rest of the answer does not depend on it (the digest leaves the id out). The
REST answer puts the id first with Python's default `", "`/`": "` separators, a different layout
from the engine's, so tests see the filter learn where the server writes the id.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from tests.filter import server_reading

CALLS = {"http": 0, "grpc": 0}
LOCK = threading.Lock()
FAILED_FIRST: set[str] = set()
# x-origin-hold: one event per name a test holds (a handful per origin). A hold nobody releases
# ends in an error answer (409 / FAILED_PRECONDITION) rather than a hung test.
HOLDS: dict[str, threading.Event] = {}
HOLD_MAX_S = 20.0


def _hold(name: str) -> threading.Event:
    with LOCK:
        return HOLDS.setdefault(name, threading.Event())


def _held_until_released(name: str | None) -> bool:
    """Wait while `name` (x-origin-hold) is held; False if it was not released in HOLD_MAX_S."""
    return not name or _hold(name).wait(HOLD_MAX_S)


def _first_with(name: str | None) -> bool:
    """True once per `x-origin-fail-first` name: that request fails."""
    if not name:
        return False
    with LOCK:
        if name in FAILED_FIRST:
            return False
        FAILED_FIRST.add(name)
        return True


def _count(kind: str) -> None:
    with LOCK:
        CALLS[kind] += 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are separate writes: with Nagle's algorithm the body waits for the
    # client's delayed ACK (~40 ms per answer on Linux).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str],
              extra: list[tuple[str, ...]] | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        for k, v in extra or []:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/calls":
            with LOCK:
                body = json.dumps(CALLS).encode()
            self._send(200, body, {"Content-Type": "application/json"})
        elif self.path.startswith("/release/"):
            _hold(self.path.removeprefix("/release/")).set()
            self._send(200, b"released", {"Content-Type": "text/plain"})
        else:
            self._send(404, b"not found", {"Content-Type": "text/plain"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        if len(data) < length:
            return  # the request was abandoned before its body arrived (e.g. a hit reset it): not served
        _count("http")
        if delay := self.headers.get("x-origin-delay"):
            time.sleep(float(delay))
        if not _held_until_released(self.headers.get("x-origin-hold")):
            self._send(409, b"x-origin-hold was never released", {"Content-Type": "text/plain"})
            return
        if _first_with(self.headers.get("x-origin-fail-first")):
            self._send(500, b"origin failed (x-origin-fail-first)", {"Content-Type": "text/plain"})
            return
        request_id, without_id = _split_rest_id(data)
        digest = hashlib.sha256(without_id).hexdigest()
        read = None
        if self.headers.get("x-origin-read"):
            try:
                read = server_reading.read_rest(self.path, list(self.headers.items()), data)
            except server_reading.Unreadable as exc:
                error = {"error": str(exc), "path": self.path}
                self._send(400, json.dumps(error).encode(), {"Content-Type": "application/json"})
                return
        size = self.headers.get("x-origin-size")
        if size is not None:
            body = (digest * (int(size) // 64 + 1)).encode()[: int(size)]
        else:
            answer = {"path": self.path, "digest": digest, "model": self.headers.get("x-model-id", ""),
                      "user": self.headers.get("x-user", ""),
                      "colors": self.headers.get_all("x-traffic-color") or []}
            if route_keys := self.headers.get_all("x-meshcache-route-key"):
                answer["route_keys"] = route_keys  # only the client role sets it; servers remove it
            if read is not None:
                answer["read"] = read
            if request_id is not None:
                answer = {"id": request_id, **answer}
            body = json.dumps(answer).encode()
        headers = {"Content-Type": "application/json"}
        if cc := self.headers.get("x-origin-cache-control"):
            headers["Cache-Control"] = cc
        if etag := self.headers.get("x-origin-etag"):
            headers["ETag"] = etag
        extra = [tuple(h.split(": ", 1)) for h in self.headers.get_all("x-origin-header") or []]
        if events := self.headers.get("x-origin-sse"):
            self._send_events(int(events), float(self.headers.get("x-origin-pace", "0")), digest)
            return
        if self.headers.get("x-origin-gzip"):
            body = gzip.compress(body, mtime=0)
            headers["Content-Encoding"] = "gzip"
        if chunk := self.headers.get("x-origin-chunked"):
            self._send_chunked(body, int(chunk), float(self.headers.get("x-origin-pace", "0")), headers, extra)
            return
        self._send(int(self.headers.get("x-origin-status", "200")), body, headers, extra)

    def _send_chunked(self, body: bytes, chunk: int, pace: float, headers: dict[str, str],
                      extra: list[tuple[str, ...]]) -> None:
        """Transfer-Encoding: chunked, `chunk` bytes at a time, `pace` seconds apart."""
        self.send_response(200)
        for k, v in [*headers.items(), *extra]:
            self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(body), chunk):
            part = body[i : i + chunk]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            if pace:
                time.sleep(pace)
        self.wfile.write(b"0\r\n\r\n")

    def _send_events(self, n: int, pace: float, digest: str) -> None:
        """An OpenAI-style SSE stream: `n` events `pace` seconds apart, each with its send time."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            event = f"data: {json.dumps({'i': i, 'sent': time.time(), 'digest': digest})}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            if pace and i < n - 1:
                time.sleep(pace)
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def _split_rest_id(data: bytes) -> tuple[str | None, bytes]:
    """The request's top-level string "id" (as a KServe server reads it) and the body without it."""
    try:
        request = json.loads(data)
    except ValueError:
        return None, data
    if not isinstance(request, dict) or not isinstance(request.get("id"), str):
        return None, data
    request_id = request.pop("id")
    return request_id, json.dumps(request, sort_keys=True).encode()


def _model_infer(request: bytes, context: grpc.ServicerContext) -> bytes:
    _count("grpc")
    metadata = dict(context.invocation_metadata())
    if delay := metadata.get("x-origin-delay"):
        time.sleep(float(delay))
    if not _held_until_released(metadata.get("x-origin-hold")):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "x-origin-hold was never released")
    if metadata.get("x-origin-grpc-fail"):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "origin asked to fail")
    if code := metadata.get("x-origin-grpc-code"):
        context.abort(grpc.StatusCode[code], f"origin asked to fail with {code}")
    if _first_with(metadata.get("x-origin-fail-first")):
        context.abort(grpc.StatusCode.UNAVAILABLE, "origin failed (x-origin-fail-first)")
    try:
        parsed = server_reading.read_grpc(request)
    except server_reading.Unreadable as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    # Echo the model_name field (1) and the id (3), attach a digest (field 5): a deterministic answer.
    return server_reading.grpc_answer(parsed, int(metadata.get("x-origin-size", "0")))


class Server(ThreadingHTTPServer):
    # socketserver's default backlog (5) refuses connections in a burst of misses.
    request_queue_size = 512


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    args = parser.parse_args()
    # No SO_REUSEPORT (on by default in gRPC): a port taken by another process fails the start
    # instead of sharing its connections.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=[("grpc.so_reuseport", 0)])
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(_model_infer)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    server.start()
    httpd = Server(("127.0.0.1", args.http_port), Handler)
    httpd.daemon_threads = True
    httpd.serve_forever()


if __name__ == "__main__":
    main()
