"""Running a docs/istio.md walk-through's commands as written, against a local cluster whose test
node runs the pods (meshcache.ctl.kube).

The commands are read from the walk-through's code blocks (`commands`), so a change to the docs
changes what runs. Each runs with `bash -c` in a work directory that has the repository's `.venv`
(as `.venv`), with `KUBECONFIG` the cluster's admin kubeconfig and kubectl/istioctl on PATH. Steps
that cannot run here as written are replaced by the project's equivalent (`Replaced`, each with
its reason): the tests assert the list of replaced steps, so a new unrunnable step fails them."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl.istiod.binary import require as require_istio
from meshcache.ctl.kube.binary import require as require_kube

DOCS = REPO_ROOT / "docs" / "istio.md"
COMMAND_TIMEOUT_S = 300.0


def section(title: str, text: str | None = None) -> str:
    """The docs' `## <title>` section (up to the next `## `)."""
    text = DOCS.read_text() if text is None else text
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, f"docs/istio.md has no section '## {title}'"
    return match.group(1)


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block, indented ones (in list items) dedented."""
    out = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", markdown, re.S | re.M):
        indent = len(match.group(1))
        out.append((match.group(2), "".join(line[indent:] for line in match.group(3).splitlines(True))))
    return out


def commands(block: str) -> list[str]:
    """The block's shell commands: continuation lines joined, comment-only and blank lines dropped
    (a trailing comment stays: bash ignores it)."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(" ".join((pending + line).split()) if pending else line.strip())
        pending = ""
    assert not pending, f"a continued line ends the block: {pending!r}"
    return out


def strip_comment(command: str) -> str:
    """The command without a trailing `# ...` comment (the docs put none inside quotes)."""
    return re.sub(r"\s+#.*$", "", command)


@dataclass
class Replaced:
    """A docs step run as the project's equivalent: `matches` the command, `run` does it."""

    pattern: str  # a regex the whole command (without its trailing comment) must match
    why: str
    run: Callable[[str], None]

    def matches(self, command: str) -> bool:
        return re.fullmatch(self.pattern, strip_comment(command)) is not None


@dataclass
class Shell:
    """The walk-through's shell: its work directory, environment and a log of what ran."""

    work: Path
    kubeconfig: Path
    ran: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    # Addresses a replaced step moved (`kubectl port-forward`: the Service's proxy on the node
    # address instead of localhost): applied to the later commands, as written otherwise.
    rewrites: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        venv = self.work / ".venv"
        if not venv.exists():
            venv.symlink_to(REPO_ROOT / ".venv")
        # `--overlay istio/overlays/...` is looked up in the current directory first.
        if not (self.work / "istio").exists():
            (self.work / "istio").symlink_to(REPO_ROOT / "istio")

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(str(p) for p in (require_kube("kubectl").parent, require_istio("istioctl").parent))
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"}

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        for old, new in self.rewrites.items():
            command = command.replace(old, new)
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.work, env=self.env(),
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"`{command}` exited {out.returncode}:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}"
        self.ran.append(command)
        return out.stdout

    def refused(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """A command that must fail: its stderr."""
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.work, env=self.env(),
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode != 0, f"`{command}` succeeded:\n{out.stdout[-1500:]}"
        return out.stderr

    def walk(self, steps: list[str], replaced: list[Replaced]) -> None:
        """Each step in order: the project's equivalent where one is listed, else verbatim."""
        for command in steps:
            rule = next((r for r in replaced if r.matches(command)), None)
            if rule is None:
                self.run(command)
            else:
                rule.run(command)
                self.replaced.append(strip_comment(command))
