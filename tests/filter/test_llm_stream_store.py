"""Only a complete, error-free event stream is stored (issue 38, docs/llm.md): a 200
`text/event-stream` chat answer that ends with an error event or without `data: [DONE]` passes to
its client byte for byte and is not stored (counted in `meshcache.not_stored.<detail>`), while a
complete one (LF or CRLF event boundaries) is a hit next time. Through a real Envoy on both
hosts, against a small SSE server run here (the engine never sends a broken stream on purpose)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.filter_config import LLM_DEMO_POLICIES
from meshcache.ctl import procs
from meshcache.ctl.mesh.demo_llm import CHAT_PATH
from tests.filter.stack import config, filter_stack

CHUNK = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}'
USAGE = 'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
ERROR = 'data: {"error": {"message": "the model stopped", "type": "server_error", "code": null}}'
# What the server streams for each prompt (the last user message's content).
STREAMS = {
    "complete": f"{CHUNK}\n\n{USAGE}\n\ndata: [DONE]\n\n",
    "complete-crlf": f"{CHUNK}\r\n\r\n{USAGE}\r\n\r\ndata: [DONE]\r\n\r\n",
    "error": f"{CHUNK}\n\n{ERROR}\n\ndata: [DONE]\n\n",
    "no-done": f"{CHUNK}\n\n{USAGE}\n\n",
}


class _SSE(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    calls: Counter[str]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["messages"][-1]["content"]
        self.calls[prompt] += 1
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        # In small chunks that split events and boundaries, as a server flushing tokens would.
        stream = STREAMS[prompt].encode()
        for at in range(0, len(stream), 40):
            part = stream[at:at + 40]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def sse_server() -> Iterator[tuple[int, Counter[str]]]:
    calls: Counter[str] = Counter()
    handler = type("Handler", (_SSE,), {"calls": calls})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], calls
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _chat(http: httpx.Client, prompt: str) -> httpx.Response:
    """A greedy streamed chat (the raw response: some of these streams are not valid SSE)."""
    body = {"model": "llama3-70b-demo", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": prompt}]}
    return http.post(CHAT_PATH, json=body)


def test_only_a_complete_stream_is_stored(tmp_path: Path, sse_server: tuple[int, Counter[str]], host: str) -> None:
    port, calls = sse_server
    policies = config(*({"model_prefix": prefix, **spec} for prefix, spec in LLM_DEMO_POLICIES.items()))
    with filter_stack(tmp_path, policies, upstream=(port, procs.free_port()), host=host) as s, \
            httpx.Client(base_url=s.url(""), timeout=30) as http:
        for prompt in ("error", "no-done", "complete", "complete-crlf"):
            first = _chat(http, prompt)
            # Streams are never held: the headers left before the end decided anything.
            assert (first.status_code, first.headers["cache-status"]) == (200, "meshcache; fwd=miss"), prompt
            assert first.content == STREAMS[prompt].encode(), f"{prompt}: passed through untouched"
            again = _chat(http, prompt)
            assert again.content == first.content
            status = again.headers["cache-status"]
            if prompt.startswith("complete"):
                assert status.startswith("meshcache; hit"), (prompt, status)
                assert calls[prompt] == 1, prompt
            else:
                assert status == "meshcache; fwd=miss", (prompt, status)
                assert calls[prompt] == 2, f"{prompt}: not stored, so the server answers again"
        s.stats_reaching({"meshcache.not_stored.stream-error": 2, "meshcache.not_stored.stream-incomplete": 2,
                          "meshcache.stores": 2, "meshcache.hits": 2})
