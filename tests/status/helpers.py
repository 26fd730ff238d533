"""The status tests' local mesh, started through the CLI, and a runner for the `meshcache` command."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshcache.ctl import procs

CLI = [str(Path(sys.executable).parent / "meshcache")]


def meshcache(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@dataclass
class RunningMesh:
    state_dir: Path
    endpoints: dict[str, Any]
    token: str

    @property
    def api_url(self) -> str:
        return str(self.endpoints["control_plane_api"])

    def client(self) -> httpx.Client:
        return procs.http_client(base_url=self.api_url, headers={"Authorization": f"Bearer {self.token}"},
                                  timeout=10)
