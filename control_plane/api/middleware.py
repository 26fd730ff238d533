"""ASGI middleware of the API."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response


class BodyLimit:
    """Rejects request bodies over `limit` bytes with 413 before the app reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = declared is not None and (not declared.isdigit() or int(declared) > self.limit)
        messages: list[Message] = []
        if not too_big:
            size, more = 0, True
            while more:
                msg = await receive()
                messages.append(msg)
                if msg["type"] != "http.request":
                    break
                size += len(msg.get("body", b""))
                more = msg.get("more_body", False)
                if size > self.limit:
                    too_big = True
                    break
        if too_big:
            resp = error_response(413, f"request body larger than {self.limit} bytes")
            await resp(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
