"""The client pod's app for `meshcache up --kube`: a TCP relay, run in the client pod's network
namespace as an app UID (not istio-proxy's 1337), from the pod's own address to the engine
Service's ClusterIP.

    host --> client pod IP:8000/8001 (inbound capture excluded for these ports)
         --> relay (app UID) --> ClusterIP:8000/8001, captured by istio-iptables to the client
             sidecar's outbound listener (15001) --> mTLS --> an engine pod's sidecar (cache) --> engine

It relays bytes only (HTTP/1.1 and h2c alike): Host / :authority, the route and every cache
decision stay the sidecars'. There is no kube-proxy on the test node, so the ClusterIP is routed
by the capture alone, as for any app container.

    python -m meshcache.ctl.kube.forward LISTEN_IP:PORT=TARGET_IP:PORT ...
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

MAX_CONNECTIONS = 256  # bounded: further clients wait in the listen backlog
CHUNK = 64 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.write_eof()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _handler(target: tuple[str, int], slots: asyncio.Semaphore) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with slots:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout=10)
            except (TimeoutError, OSError):
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            for w in (writer, up_writer):
                w.close()
    return handle


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(routes: list[tuple[tuple[str, int], tuple[str, int]]]) -> None:
    slots = asyncio.Semaphore(MAX_CONNECTIONS)
    servers = [await asyncio.start_server(_handler(target, slots), *listen) for listen, target in routes]
    print("forwarding " + ", ".join(f"{a[0]}:{a[1]} -> {b[0]}:{b[1]}" for a, b in routes), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str]) -> int:
    routes = [(_addr(listen), _addr(target)) for listen, _, target in (a.partition("=") for a in argv)]
    if not routes:
        print("usage: python -m meshcache.ctl.kube.forward LISTEN_IP:PORT=TARGET_IP:PORT ...", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(routes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
