"""The last good snapshot on local disk, so a restarted control plane that cannot reach Redis
serves what it served before instead of nothing or version 0 (control_plane/README.md,
"Never less than the last good snapshot").

One file, `<state dir>/snapshot.json`: `{"format": 1, "key_prefix": ..., "snapshot": <record>}`.
Written atomically (a temporary file in the same directory, fsynced, renamed over the old one,
the directory fsynced), so a crash leaves the old file or the new one, never half of either.
Several processes may share the directory (`--xds-workers`): a lock file serialises them and a
write never replaces a newer version. A file that cannot be read, is corrupt, or belongs to
another `--key-prefix` is ignored (logged): nothing is better than a wrong snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from .metrics import Metrics
from .snapshots import Snapshot, SnapshotCache

log = logging.getLogger("meshcache.control_plane.state")
FORMAT = 1
FILE_NAME = "snapshot.json"
MAX_BYTES = 64 * 1024 * 1024  # 1000 policies are well under 4 MiB; a bigger file is not ours


class StateFile:
    def __init__(self, directory: Path, key_prefix: str) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self.key_prefix = key_prefix

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def load(self) -> Snapshot | None:
        """The saved snapshot, or None (no file, or one that is not a valid snapshot of ours)."""
        try:
            if self.path.stat().st_size > MAX_BYTES:
                log.error("%s is larger than %d bytes: ignored", self.path, MAX_BYTES)
                return None
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.error("cannot read %s (%s): ignored", self.path, exc)
            return None
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
            if doc.get("key_prefix") != self.key_prefix:
                log.error("%s belongs to key prefix %r, this control plane uses %r: ignored",
                          self.path, doc.get("key_prefix"), self.key_prefix)
                return None
            snap = Snapshot.from_record(json.dumps(doc["snapshot"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("%s is not a valid snapshot file (%s): ignored", self.path, exc)
            return None
        return snap if snap.version > 0 else None

    def save(self, snapshot: Snapshot) -> bool:
        """Write `snapshot` unless the file already holds a newer one; True when written."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._locked():
            saved = self.load()
            if saved is not None and saved.version >= snapshot.version:
                return False
            body = json.dumps({"format": FORMAT, "key_prefix": self.key_prefix,
                               "snapshot": json.loads(snapshot.to_record())}, separators=(",", ":"))
            tmp = self.directory / f".{FILE_NAME}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(body.encode())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return True


class Persister:
    """Saves every snapshot this replica installs (the newest one, after a burst) to the state
    file, off the event loop; a failed write is logged, counted and retried on the next snapshot."""

    def __init__(self, file: StateFile, cache: SnapshotCache, metrics: Metrics) -> None:
        self.file = file
        self.cache = cache
        self.metrics = metrics
        self.saved_version = 0
        self._wake = asyncio.Event()

    async def run(self) -> None:
        watch = self.cache.watch(lambda _snap: self._wake.set())
        self._wake.set()  # what start() installed
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                snap = self.cache.current
                if not self.cache.known or snap.version <= self.saved_version:
                    continue
                try:
                    await asyncio.to_thread(self.file.save, snap)
                except OSError as exc:
                    self.metrics.state_writes.labels("error").inc()
                    log.error("cannot save snapshot %d to %s: %s", snap.version, self.file.path, exc)
                    continue
                self.saved_version = snap.version
                self.metrics.state_writes.labels("ok").inc()
        finally:
            self.cache.unwatch(watch)
