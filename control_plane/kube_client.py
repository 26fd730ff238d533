"""A small Kubernetes API client on httpx (a dependency already): the few calls the writer makes
(list by label, get, server-side apply, delete with a precondition), authenticated in-cluster (the
pod's ServiceAccount token, re-read as kubelet rotates it, and CA) or from a kubeconfig file (its
current context: a token, a token file or a client certificate; a CA or the system's).

Why not the `kubernetes` package: four REST calls do not need its 40k lines of generated models,
and its asyncio flavour is another package again; every call here is one documented endpoint.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0  # client-go's period; kubelet refreshes bound tokens well before expiry
LIST_PAGE = 250
LIST_MAX_PAGES = 8  # a namespace holds a handful of meshcache objects; more is someone else's
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the body is JSON
Obj = dict[str, Any]


class KubeConfigError(ValueError):
    """The connection settings are unusable (missing file, unsupported auth): fails at startup."""


class KubeError(Exception):
    """An API call that failed: `status` 0 for transport errors (refused, timeout, TLS)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def conflict(self) -> bool:
        return self.status == 409


class _TokenFile:
    """A bearer token read from a file, re-read every TOKEN_REREAD_S (bound tokens rotate)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token, self._read_at = "", -TOKEN_REREAD_S
        self()  # a missing file fails at startup

    def __call__(self) -> str:
        now = time.monotonic()
        if now - self._read_at >= TOKEN_REREAD_S:
            try:
                self._token = self.path.read_text().strip()
            except OSError as exc:
                if not self._token:
                    raise KubeConfigError(f"cannot read the token {self.path}: {exc}") from exc
            self._read_at = now
        return self._token


class _Bearer(httpx.Auth):
    def __init__(self, token: Callable[[], str]) -> None:
        self._token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._token()}"
        yield request


@dataclass
class KubeConnection:
    server: str  # https://host:port
    verify: ssl.SSLContext
    token: Callable[[], str] | None = None
    source: str = ""  # for logs: "in-cluster" or the kubeconfig path and context


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR, env: dict[str, str] | None = None) -> KubeConnection:
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError("not in a cluster (KUBERNETES_SERVICE_HOST/PORT unset): set "
                              "MESHCACHE_CP_KUBECONFIG to a kubeconfig file")
    if ":" in host:
        host = f"[{host}]"
    ca = sa_dir / "ca.crt"
    if not ca.is_file():
        raise KubeConfigError(f"no {ca}: is the ServiceAccount token mounted (automountServiceAccountToken)?")
    return KubeConnection(f"https://{host}:{port}", ssl.create_default_context(cafile=str(ca)),
                          _TokenFile(sa_dir / "token"), "in-cluster")


def _path(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _named(items: list[Obj], name: str, what: str, where: Path) -> Obj:
    for item in items or []:
        if item.get("name") == name:
            return dict(item.get(what) or {})
    raise KubeConfigError(f"{where}: no {what} named {name!r}")


def from_kubeconfig(path: Path) -> KubeConnection:
    """The kubeconfig's current context. Relative paths are relative to the file, as kubectl reads them."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
    base = path.parent
    context_name = config.get("current-context") or ""
    if not context_name:
        raise KubeConfigError(f"{path}: no current-context")
    context = _named(config.get("contexts", []), context_name, "context", path)
    cluster = _named(config.get("clusters", []), context.get("cluster", ""), "cluster", path)
    user = _named(config.get("users", []), context.get("user", ""), "user", path) if context.get("user") else {}
    server = str(cluster.get("server", "")).rstrip("/")
    if not server.startswith("https://"):
        raise KubeConfigError(f"{path}: cluster server {server!r} is not https://")
    if cluster.get("insecure-skip-tls-verify"):
        raise KubeConfigError(f"{path}: insecure-skip-tls-verify is not supported (give the cluster's CA)")
    if "certificate-authority-data" in cluster:
        ctx = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    elif "certificate-authority" in cluster:
        ctx = ssl.create_default_context(cafile=str(_path(base, cluster["certificate-authority"])))
    else:
        ctx = ssl.create_default_context()
    if cluster.get("tls-server-name"):
        raise KubeConfigError(f"{path}: tls-server-name is not supported")
    token: Callable[[], str] | None = None
    if user.get("token"):
        value = str(user["token"])
        token = lambda: value  # noqa: E731 - a constant token
    elif user.get("tokenFile"):
        token = _TokenFile(_path(base, user["tokenFile"]))
    elif "client-certificate" in user or "client-certificate-data" in user:
        _load_client_cert(ctx, user, base)
    elif user:
        unsupported = ", ".join(sorted(user)) or "nothing"
        raise KubeConfigError(f"{path}: user {context.get('user')!r} has {unsupported}: use a token, tokenFile or "
                              "client certificate")
    return KubeConnection(server, ctx, token, f"{path} (context {context_name})")


def _load_client_cert(ctx: ssl.SSLContext, user: Obj, base: Path) -> None:
    """ssl loads certificates from files only: inline data goes through a private temporary directory."""
    with tempfile.TemporaryDirectory(prefix="meshcache-kube-") as tmp:
        files = []
        for key in ("client-certificate", "client-key"):
            if f"{key}-data" in user:
                p = Path(tmp) / key
                p.write_bytes(base64.b64decode(user[f"{key}-data"]))
                files.append(p)
            elif key in user:
                files.append(_path(base, user[key]))
            else:
                raise KubeConfigError(f"kubeconfig user has a client certificate without {key}")
        ctx.load_cert_chain(str(files[0]), str(files[1]))


def connect(kubeconfig: Path | None) -> KubeConnection:
    return from_kubeconfig(kubeconfig) if kubeconfig is not None else in_cluster()


def _error(response: httpx.Response) -> KubeError:
    try:
        status = response.json()
        reason, message = str(status.get("reason", "")), str(status.get("message", ""))
    except ValueError:
        reason, message = response.reason_phrase, response.text[:500]
    return KubeError(response.status_code, reason or response.reason_phrase, message)


class KubeApi:
    def __init__(self, conn: KubeConnection, timeout_s: float) -> None:
        self.conn = conn
        self._client = httpx.AsyncClient(base_url=conn.server, verify=conn.verify, timeout=timeout_s,
                                         auth=_Bearer(conn.token) if conn.token else None,
                                         headers={"Accept": "application/json"})

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeError(0, type(exc).__name__, str(exc) or repr(exc)) from exc

    async def list(self, path: str, label_selector: str) -> list[Obj]:
        items: list[Obj] = []
        params: dict[str, str | int] = {"labelSelector": label_selector, "limit": LIST_PAGE}
        for _ in range(LIST_MAX_PAGES):
            r = await self._call("GET", path, params=params)
            if r.status_code != 200:
                raise _error(r)
            body = r.json()
            items += body.get("items", [])
            token = body.get("metadata", {}).get("continue")
            if not token:
                return items
            params["continue"] = token
        raise KubeError(0, "TooMany", f"{path}: more than {LIST_PAGE * LIST_MAX_PAGES} objects match {label_selector}")

    async def get(self, path: str) -> Obj | None:
        r = await self._call("GET", path)
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise _error(r)
        return r.json()  # type: ignore[no-any-return]

    async def apply(self, path: str, obj: Obj, field_manager: str, force: bool) -> Obj:
        """Server-side apply (PATCH application/apply-patch+yaml): creates or updates the fields
        `field_manager` owns. `force` takes fields another manager owns; without it that is a 409."""
        params = {"fieldManager": field_manager, **({"force": "true"} if force else {})}
        r = await self._call("PATCH", path, params=params, content=json.dumps(obj).encode(),
                             headers={"Content-Type": APPLY_CONTENT_TYPE})
        if r.status_code not in (200, 201):
            raise _error(r)
        return r.json()  # type: ignore[no-any-return]

    async def delete(self, path: str, resource_version: str) -> bool:
        """Deletes the object only if it is still at `resource_version` (False: already gone)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": resource_version}}
        r = await self._call("DELETE", path, json=body)
        if r.status_code == 404:
            return False
        if r.status_code not in (200, 202):
            raise _error(r)
        return True

    async def close(self) -> None:
        await self._client.aclose()
