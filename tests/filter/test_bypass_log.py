"""Issue 35, "why wasn't this cached": each bypass is counted per reason and, at Envoy's debug
level, logged with its reason, model and path (filter/core/src/logs.rs), the same line on both
hosts; at info (production's level) the filter says nothing about bypasses."""

from __future__ import annotations

from pathlib import Path

import httpx

from meshcache.ctl import procs
from tests.filter.stack import config, filter_stack, policy
from tests.helpers.wait import eventually

BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
# The logger each host writes to: proxy-wasm's `wasm`, the dynamic module's `dynamic_modules`.
LOGGER = {"wasm": "wasm", "native": "dynamic_modules", "native-1.39": "dynamic_modules"}


def test_a_bypass_is_logged_at_debug_with_its_reason_model_and_path(tmp_path: Path, host: str) -> None:
    logger = LOGGER[host]
    with filter_stack(tmp_path, config(policy("m")), host=host,
                      envoy_args=["--component-log-level", f"{logger}:debug"]) as s, httpx.Client() as c:
        log = s.log_dir / "envoy.log"

        def logged(line: str) -> str:
            text = log.read_text(errors="replace")
            assert line in text, f"{line!r} not in the Envoy log yet"
            return text

        repeated = [("x-model-id", "m"), ("x-model-id", "m"), ("content-type", "application/json")]
        r = c.post(s.url("/v2/models/m/infer?token=secret"), content=BODY, headers=repeated)
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=repeated-header"
        text = eventually(lambda: logged("meshcache: bypass detail=repeated-header model=m path=/v2/models/m/infer"))
        assert "token=secret" not in text, "the query is not logged"
        assert s.stats_reaching({"meshcache.bypass.repeated-header": 1})

        # At info the bypass is counted but not logged; back at debug the next one is (in order:
        # one worker, one client), so the one in between was not.
        admin = f"http://127.0.0.1:{s.admin_port}/logging"
        procs.local_http().post(admin, params={logger: "info"}, timeout=5).raise_for_status()
        r = c.post(s.url("/v2/models/m/infer"), content=BODY, headers={"cache-control": "no-store"})
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-store"
        procs.local_http().post(admin, params={logger: "debug"}, timeout=5).raise_for_status()
        r = c.post(s.url("/v2/models/other/infer"), content=BODY)
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-policy"
        text = eventually(lambda: logged("meshcache: bypass detail=no-policy model=other path=/v2/models/other/infer"))
        assert "detail=no-store" not in text, "a bypass at info level was logged"
        assert s.stats_reaching({"meshcache.bypass.no-store": 1, "meshcache.bypass.no-policy": 1})
