"""Rotating the xDS certificates with overlap (docs/istio.md, "Rotating the xDS certificates"),
against a real control plane serving xDS over TLS from a Kubernetes-style Secret volume and real
gRPC TLS clients in istiod's role (SIMPLE: they check the chain against the CA bundle they were
started with and the DNS name, as istiod's configSources client does).

`meshcache istio xds-certs` reuses the CA unless `--new-ca`; a new CA goes out as a bundle with
the old one first, then the serving certificate switches (the control plane re-reads it, no
restart), then the old CA is dropped. Across the switch: new connections every few tens of ms,
none fails; the streams opened before it (one trusting only the old CA) keep receiving pushes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from meshcache.control_plane.xds_client import XdsClient, plugin_config_of
from meshcache.ctl.cli import main
from meshcache.ctl.istio import xds_tls
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.tls import presented_serial, serial_of
from tests.helpers.wait import aeventually, eventually

NAMESPACE = "ml"
SERVER_NAME = xds_tls.dns_names(NAMESPACE)[0]


def xds_certs(out: Path, *flags: str) -> str:
    """`meshcache istio xds-certs` in-process; its stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["istio", "xds-certs", "--namespace", NAMESPACE, "--out", str(out), *flags]) == 0
    return buf.getvalue()


def mount(volume: Path, certs: Path, version: int, key_from: Path | None = None) -> None:
    """Publish tls.crt/tls.key as the kubelet updates a Secret volume: a new `..vN` directory,
    then one atomic swap of the `..data` symlink the files point through."""
    target = volume / f"..v{version}"
    target.mkdir(parents=True)
    shutil.copy(certs / "tls.crt", target / "tls.crt")
    shutil.copy((key_from or certs) / "tls.key", target / "tls.key")
    tmp = volume / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, volume / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def channel(port: int, ca_pem: bytes) -> grpc.aio.Channel:
    # Own subchannel pool: every channel makes its own connection (its own handshake).
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=ca_pem),
        options=[("grpc.ssl_target_name_override", SERVER_NAME), ("grpc.use_local_subchannel_pool", 1)])


async def first_push(port: int, ca_pem: bytes, node: str, timeout: float = 5.0) -> dict[str, Any]:
    """A new connection trusting `ca_pem`: its first push (raises if the handshake fails)."""
    async with channel(port, ca_pem) as ch:
        client = XdsClient(ch, node)
        await client.subscribe()
        try:
            return plugin_config_of(await client.recv(timeout=timeout))
        finally:
            await client.close()


def connects(port: int, ca_pem: bytes) -> bool:
    try:
        run(first_push(port, ca_pem, "probe-once", timeout=3))
    except (TimeoutError, grpc.aio.AioRpcError, ConnectionError):
        return False
    return True


def test_rotation_with_overlap_fails_no_connection_and_breaks_no_stream(
        tmp_path: Path, start_cp: Callable[..., ControlPlaneProc]) -> None:
    certs, volume = tmp_path / "certs", tmp_path / "secret-volume"
    first = xds_certs(certs)
    assert "create secret tls meshcache-cp-xds-tls" in first and "ca.crt=" + str(certs / "ca-bundle.crt") in first
    ca1 = (certs / "ca.crt").read_bytes()
    assert (certs / "ca-bundle.crt").read_bytes() == ca1

    # Renewal without --new-ca: the same CA, a new server certificate (istiod needs nothing).
    serial1 = serial_of((certs / "tls.crt").read_bytes())
    renew = xds_certs(certs)
    assert (certs / "ca.crt").read_bytes() == ca1 and "reused the CA" in renew
    assert "meshcache-cp-xds-ca" not in renew  # istiod's Secret stays as it is
    assert serial_of((certs / "tls.crt").read_bytes()) != serial1
    x509.load_pem_x509_certificate((certs / "tls.crt").read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca1))

    mount(volume, certs, 1)
    cp = start_cp(extra_env={"MESHCACHE_CP_XDS_TLS_CERT": str(volume / "tls.crt"),
                             "MESHCACHE_CP_XDS_TLS_KEY": str(volume / "tls.key")})
    with cp.client() as c:
        assert c.put("/v1/policies/resnet", json={"ttl_s": 60}).status_code == 200
    old_serial = presented_serial(cp.xds_port)

    # 1. A new CA: the old one stays in the bundle; the steps put the bundle before the certificate.
    rotate = xds_certs(certs, "--new-ca")
    assert rotate.index("meshcache-cp-xds-ca") < rotate.index("rollout restart deployment/istiod") \
        < rotate.index("create secret tls meshcache-cp-xds-tls")
    assert (certs / "ca-previous.crt").read_bytes() == ca1
    ca2, bundle = (certs / "ca.crt").read_bytes(), (certs / "ca-bundle.crt").read_bytes()
    assert ca2 != ca1 and bundle == ca2 + ca1
    assert xds_certs_refuses_a_second_rotation(certs)

    async def rotation() -> tuple[int, list[str], dict[str, Any], dict[str, Any]]:
        # "istiod" before the rotation (old CA only) and after its restart with the bundle.
        async with channel(cp.xds_port, ca1) as ch_old, channel(cp.xds_port, bundle) as ch_new:
            old, new = XdsClient(ch_old, "istiod-old-ca"), XdsClient(ch_new, "istiod-bundle")
            for client in (old, new):
                await client.subscribe()
                resp = await client.recv()
                assert plugin_config_of(resp)["version"] == "1"
                await client.ack(resp)
            failures: list[str] = []
            probes = 0
            switched_at: list[float] = []

            async def probe() -> None:
                # New connections from half a second before the swap to one second after the switch.
                nonlocal probes
                while not switched_at or time.monotonic() < switched_at[0] + 1.0:
                    try:
                        assert (await first_push(cp.xds_port, bundle, f"probe-{probes}"))["version"] in ("1", "2")
                    except Exception as exc:  # noqa: BLE001 - every failure is the finding
                        failures.append(repr(exc))
                    probes += 1
                    await asyncio.sleep(0.02)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.5)
            # 2. The serving certificate switches (the Secret volume's atomic swap).
            mount(volume, certs, 2)
            await aeventually(lambda: presented_serial(cp.xds_port) != old_serial, timeout=10)
            switched_at.append(time.monotonic())
            await prober
            # The streams opened before the switch still get pushes.
            with cp.client() as c:
                assert c.put("/v1/policies/resnet", json={"ttl_s": 120}).status_code == 200
            pushed_old, pushed_new = plugin_config_of(await old.recv()), plugin_config_of(await new.recv())
            await old.close()
            await new.close()
            return probes, failures, pushed_old, pushed_new

    probes, failures, pushed_old, pushed_new = run(rotation())
    print(f"new connections across the switch: {probes}, failed: {len(failures)}")
    assert failures == [] and probes >= 20
    assert pushed_old["version"] == pushed_new["version"] == "2"
    assert presented_serial(cp.xds_port) == serial_of((certs / "tls.crt").read_bytes())
    # Without the overlap, a client trusting only the old CA could no longer connect.
    assert not connects(cp.xds_port, ca1)
    assert connects(cp.xds_port, ca2)

    # A half-published update (a new certificate with the old key) keeps the pair loaded.
    serving = presented_serial(cp.xds_port)
    xds_certs(certs)  # renew: new tls.crt/tls.key from CA2
    mount(volume, certs, 3, key_from=volume / "..v2")
    assert connects(cp.xds_port, bundle) and presented_serial(cp.xds_port) == serving
    mount(volume, certs, 4)  # the complete pair: loaded
    eventually(lambda: presented_serial(cp.xds_port) == serial_of((certs / "tls.crt").read_bytes()), timeout=10)

    # 3. The old CA leaves the bundle.
    drop = xds_certs(certs, "--drop-old-ca")
    assert "meshcache-cp-xds-ca" in drop and "create secret tls" not in drop
    assert (certs / "ca-bundle.crt").read_bytes() == ca2 and not (certs / "ca-previous.crt").exists()
    assert connects(cp.xds_port, (certs / "ca-bundle.crt").read_bytes())


def xds_certs_refuses_a_second_rotation(certs: Path) -> bool:
    """A second --new-ca before --drop-old-ca would push a CA still in use out of the bundle."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["istio", "xds-certs", "--namespace", NAMESPACE, "--out", str(certs), "--new-ca"])
    return code == 2 and "rotation is still under way" in err.getvalue()
