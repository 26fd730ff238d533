"""A minimal HTTP/2 (h2c, prior knowledge) client for what httpx and grpcio cannot send: a request
whose body ends with trailers. One request per connection, bounded in time and size."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

MAX_ANSWER_BYTES = 4 * 1024 * 1024


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    trailers: list[tuple[str, str]] = field(default_factory=list)
    reset: bool = False

    def header(self, name: str) -> str | None:
        """The first value of `name` in the headers, else in the trailers."""
        for k, v in (*self.headers, *self.trailers):
            if k == name:
                return v
        return None


def post_with_trailers(port: int, path: str, headers: list[tuple[str, str]], body: bytes,
                       trailers: list[tuple[str, str]], timeout: float = 10.0) -> Answer:
    """POSTs `body` to 127.0.0.1:`port` over HTTP/2, ending the stream with `trailers` (not with
    the last DATA frame), and returns the whole answer."""
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        request = [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"), (":path", path),
                   *headers]
        conn.send_headers(stream, request, end_stream=False)
        step = conn.max_outbound_frame_size
        for i in range(0, len(body), step):
            conn.send_data(stream, body[i:i + step], end_stream=False)
        conn.send_headers(stream, trailers, end_stream=True)
        sock.sendall(conn.data_to_send())
        answer = Answer(0, [], b"")
        chunks: list[bytes] = []
        size = 0
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the connection closed before the answer ended")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    answer.headers = [(k, v) for k, v in event.headers if not k.startswith(":")]
                    answer.status = int(dict(event.headers)[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    size += len(event.data)
                    if size > MAX_ANSWER_BYTES:
                        raise ValueError(f"answer over {MAX_ANSWER_BYTES} bytes")
                    chunks.append(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    answer.trailers = list(event.headers)
                elif isinstance(event, h2.events.StreamReset):
                    answer.reset = True
                if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    answer.body = b"".join(chunks)
                    return answer
            sock.sendall(conn.data_to_send())
