"""A small client of the control-plane HTTP API (used by `up`, `demo` and `meshcache policy`)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from meshcache.ctl import procs


class ApiError(RuntimeError):
    """The control plane refused or could not be reached; the message says why. `status` is the
    HTTP status of a refusal (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class PolicyApi:
    def __init__(self, url: str, token: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._client = procs.http_client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                         timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PolicyApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"control plane at {self.url} unreachable: {exc}") from exc
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(f"{method} {path}: {r.status_code} {detail}", r.status_code)
        return r.json()

    def policies(self) -> dict[str, Any]:
        return self._call("GET", "/v1/policies")  # type: ignore[no-any-return]

    def version(self) -> int:
        return int(self.policies()["version"])

    def put(self, model_prefix: str, spec: dict[str, Any], if_match: int | None = None) -> dict[str, Any]:
        """Create or replace a whole policy (fields not in `spec` take their defaults)."""
        headers = {"If-Match": f'"{if_match}"'} if if_match is not None else {}
        return self._call("PUT", f"/v1/policies/{model_prefix}", json=spec,  # type: ignore[no-any-return]
                          headers=headers)

    def patch(self, model_prefix: str, patch: dict[str, Any], if_match: int | None = None) -> dict[str, Any]:
        """Change only the fields in `patch` (JSON merge patch: None resets a field to its default)."""
        headers = {"Content-Type": "application/merge-patch+json"}
        if if_match is not None:
            headers["If-Match"] = f'"{if_match}"'
        return self._call("PATCH", f"/v1/policies/{model_prefix}",  # type: ignore[no-any-return]
                          content=json.dumps(patch).encode(), headers=headers)

    def delete(self, model_prefix: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/policies/{model_prefix}")  # type: ignore[no-any-return]

    def purge(self, model_prefix: str) -> dict[str, Any]:
        return self._call("POST", "/v1/purge", json={"model_prefix": model_prefix})  # type: ignore[no-any-return]

    def proxies(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/proxies")["proxies"]  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/stats")  # type: ignore[no-any-return]

    def wait_acked(self, node_id: str, version: int, timeout: float = 10.0) -> None:
        """Until the proxy `node_id` has ACKed snapshot `version` (or a later one) over xDS."""
        deadline = time.monotonic() + timeout
        seen = "not connected"
        while time.monotonic() < deadline:
            for p in self.proxies():
                if p["node_id"] == node_id:
                    seen = f"acked {p['acked_version'] or 'nothing'}"
                    if p["acked_version"].isdigit() and int(p["acked_version"]) >= version:
                        return
                    if p.get("last_nack") and p["last_nack"]["version"] == str(version):
                        raise ApiError(f"{node_id} rejected policy version {version}: {p['last_nack']['error']}")
            time.sleep(0.05)
        raise ApiError(f"{node_id} did not apply policy version {version} within {timeout:.0f}s ({seen})")
