"""scope "principal": entries are per peer identity (URI SAN of the mTLS client certificate)."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from meshcache.ctl.pki import CertificateAuthority, Identity, spiffe_id
from tests.filter.stack import config, filter_stack, policy

BODY = b'{"inputs": []}'


def _client(identity: Identity) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(identity.ca))
    ctx.load_cert_chain(str(identity.cert), str(identity.key))
    return httpx.Client(verify=ctx)


@pytest.mark.envoy_1_39
def test_entries_are_separated_by_peer_identity(tmp_path: Path, host: str) -> None:
    ca = CertificateAuthority.create()
    server = ca.issue(spiffe_id("ml", "engine"), tmp_path / "pki", "server")
    alice = ca.issue(spiffe_id("team-a", "app"), tmp_path / "pki", "alice")
    bob = ca.issue(spiffe_id("team-b", "app"), tmp_path / "pki", "bob")
    cfg = config(policy("private", scope="principal"), policy("shared"))
    with filter_stack(tmp_path, cfg, tls=server, host=host) as s, _client(alice) as a, _client(bob) as b:
        url = f"https://localhost:{s.listen_port}/v2/models/private/infer"
        # Authorization does not bypass a principal-scoped policy: the entry is the caller's own.
        auth = {"authorization": "Bearer token"}
        assert a.post(url, content=BODY, headers=auth).headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert a.post(url, content=BODY, headers=auth).headers["cache-status"].startswith("meshcache; hit")
        assert b.post(url, content=BODY, headers=auth).headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert b.post(url, content=BODY, headers=auth).headers["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["http"] == 2

        shared = f"https://localhost:{s.listen_port}/v2/models/shared/infer"
        assert a.post(shared, content=BODY).headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert b.post(shared, content=BODY).headers["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["http"] == 3
