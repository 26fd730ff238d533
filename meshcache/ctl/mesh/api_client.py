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


def _write_options(if_match: int | None, dry_run: bool) -> dict[str, Any]:
    """Request options of a write: If-Match on a snapshot version, `dry_run` (nothing written)."""
    out: dict[str, Any] = {}
    if if_match is not None:
        out["headers"] = {"If-Match": f'"{if_match}"'}
    if dry_run:
        out["params"] = {"dry_run": "true"}
    return out


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
        return self._request(method, path, **kwargs).json()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
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
        return r

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

    def delete(self, model_prefix: str, if_match: int | None = None, dry_run: bool = False) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/policies/{model_prefix}",  # type: ignore[no-any-return]
                          **_write_options(if_match, dry_run))

    def purge(self, model_prefix: str | None, if_match: int | None = None, dry_run: bool = False
              ) -> dict[str, Any]:
        """One model's entries, or (`model_prefix` None) every policy's."""
        body = {"model_prefix": model_prefix} if model_prefix is not None else {"all": True}
        return self._call("POST", "/v1/purge", json=body,  # type: ignore[no-any-return]
                          **_write_options(if_match, dry_run))

    def history(self, limit: int = 20) -> dict[str, Any]:
        return self._call("GET", "/v1/snapshots", params={"limit": limit})  # type: ignore[no-any-return]

    def rollback(self, version: int, if_match: int | None = None, dry_run: bool = False) -> dict[str, Any]:
        return self._call("POST", "/v1/rollback", json={"version": version},  # type: ignore[no-any-return]
                          **_write_options(if_match, dry_run))

    def limits(self) -> tuple[dict[str, Any], int]:
        """The global limits and the snapshot version they belong to (the ETag)."""
        r = self._request("GET", "/v1/limits")
        return r.json(), int(r.headers["ETag"].strip('"'))

    def set_limits(self, limits: dict[str, Any], if_match: int | None = None, dry_run: bool = False
                   ) -> dict[str, Any]:
        return self._call("PUT", "/v1/limits", json=limits,  # type: ignore[no-any-return]
                          **_write_options(if_match, dry_run))

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
