"""deploy/README.md's access-log recipe, run as written: Envoy logs each request's Cache-Status
(hit, stored miss, bypass and its reason) in the recipe's JSON format, on both hosts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.contract.paths import REPO_ROOT
from tests.filter.stack import config, filter_stack, policy
from tests.helpers.wait import eventually

BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def recipe() -> list[dict[str, Any]]:
    """The YAML block after the recipe marker in deploy/README.md."""
    text = (REPO_ROOT / "deploy" / "README.md").read_text()
    block = re.search(r"<!-- access-log-recipe -->\n```yaml\n(.*?)```", text, re.S)
    assert block, "deploy/README.md has no access-log recipe block"
    return yaml.safe_load(block.group(1))["access_log"]  # type: ignore[no-any-return]


def test_the_access_log_recipe_logs_cache_status(tmp_path: Path, host: str) -> None:
    entries = recipe()
    assert len(entries) == 1
    # The recipe logs to stdout; here to a file, with the recipe's format unchanged.
    log_path = tmp_path / "access.log"
    to_file = [{"name": "envoy.access_loggers.file",
                "typed_config": {"@type": FILE_LOG, "path": str(log_path),
                                 "log_format": entries[0]["typed_config"]["log_format"]}}]
    # Envoy writes file access logs out every 10 s by default (--file-flush-interval-msec), which a
    # wait of 10 s races; flush often so the wait is for the lines, not the timer.
    with filter_stack(tmp_path, config(policy("m")), host=host, access_log=to_file,
                      envoy_args=["--file-flush-interval-msec", "100"]) as s, httpx.Client() as c:
        statuses = [c.post(s.url(path), content=BODY, headers=headers).headers.get("cache-status")
                    for path, headers in (("/v2/models/m/infer", {}), ("/v2/models/m/infer", {}),
                                          ("/v2/models/other/infer", {}),
                                          ("/v2/models/m/infer", {"cache-control": "no-store"}),
                                          ("/upload", {}))]
        assert statuses[0] == "meshcache; fwd=miss; stored" and statuses[1].startswith("meshcache; hit"), statuses

        def logged() -> list[dict[str, Any]]:
            lines = log_path.read_text().splitlines() if log_path.exists() else []
            assert len(lines) == len(statuses), lines
            return [json.loads(line) for line in lines]

        records = eventually(logged, 10)
    # Envoy writes the lines in the order the requests finished: one client, so in order.
    assert [r["cache_status"] for r in records] == statuses
    assert statuses[2:4] == ["meshcache; fwd=bypass; detail=no-policy", "meshcache; fwd=bypass; detail=no-store"]
    assert statuses[4] is None  # not an inference path: the filter stays silent, the field is null
    assert [r["path"] for r in records][:3] == ["/v2/models/m/infer", "/v2/models/m/infer", "/v2/models/other/infer"]
    assert {r["status"] for r in records} == {200}
