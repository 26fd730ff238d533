"""`delivery: kube`: the Istio objects of the current snapshot written to the Kubernetes API server,
where istiod reads them as any Istio config (no configSources entry, nothing of istiod waits for
this process). The same one-way flow as xDS: store -> snapshot cache -> this writer.

One reconcile = list our objects (label `app.kubernetes.io/managed-by: meshcache-control-plane`),
server-side apply each object of the snapshot that differs, delete ours that the snapshot no
longer has. Run on every new snapshot and every `kube_resync_s` (drift: an object deleted or
edited by hand), with capped exponential backoff after a failure. The rules that keep it from
ever taking config away by accident:
- nothing is written before the cache holds a real snapshot (version > 0): a control plane that
  starts without its store, or whose store has nothing, leaves the objects as they are;
- never backwards: every object carries its snapshot version (annotation); when any of ours is
  newer than this replica's snapshot, this replica writes and deletes nothing (another replica
  is ahead, or this one is stale), and every update and delete is conditional on the
  resourceVersion it was decided on (a 409 re-lists);
- only our own objects: an object is ours when our field manager applied it. Ours are applied with
  `force` (fields someone edited by hand go back, as with any controller); an object of the same
  name that someone else made is neither overwritten nor deleted: it is reported (log, metric).

Removal with the install: every object is owned (`ownerReferences`) by the writer's Role
(`extensions.WRITER_ROLE`, read each pass for its uid), so Kubernetes' garbage collector deletes
them when the install goes (`helm uninstall`, `kubectl delete -f`), the Role with it; nothing this
process does (a restart, a crash, a rollout) deletes the Role. A Role it may not read (another RBAC
setup) leaves the objects unowned: they are written as before and stay after an uninstall. A Role
that does not exist (the install being removed) makes a pass write nothing: an apply without the
owner would take it off the objects and keep them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from meshcache.contract import extensions
from meshcache.contract.extensions import FIELD_MANAGER, KUBE_RESOURCES, MANAGED_BY, SNAPSHOT_ANNOTATION

from .istio_objects import IstioObjects
from .kube_client import KubeApi, KubeError
from .metrics import Metrics
from .snapshots import Snapshot, SnapshotCache, SnapshotMemo

log = logging.getLogger("meshcache.control_plane.kube")
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 10.0
SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
Obj = dict[str, Any]


class OwnerGone(Exception):
    """The writer's Role is not there."""


def servable(snapshot: Snapshot) -> bool:
    """A snapshot the store really holds. Version 0 is the cache's placeholder before any snapshot
    was loaded (store unreachable at start, or never configured): writing it would empty the mesh."""
    return snapshot.version > 0


def ours(obj: Obj) -> bool:
    """Applied by this control plane's field manager (a label alone can be copied by anyone)."""
    return any(m.get("manager") == FIELD_MANAGER and m.get("operation") == "Apply"
               for m in obj["metadata"].get("managedFields") or [])


def version_of(obj: Obj) -> int:
    value = (obj["metadata"].get("annotations") or {}).get(SNAPSHOT_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0


def unchanged(current: Obj, desired: Obj) -> bool:
    meta, want = current["metadata"], desired["metadata"]
    owners = {(o.get("kind"), o.get("name"), o.get("uid")) for o in meta.get("ownerReferences") or []}
    return (current.get("spec") == desired["spec"]
            and all((meta.get("labels") or {}).get(k) == v for k, v in want["labels"].items())
            and all((meta.get("annotations") or {}).get(k) == v for k, v in want["annotations"].items())
            and all((o["kind"], o["name"], o["uid"]) in owners for o in want.get("ownerReferences", [])))


def with_owner(obj: Obj, owner: Obj | None) -> Obj:
    if owner is None:
        return obj
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [extensions.owner_reference(owner)]}}


class KubeWriter:
    def __init__(self, cache: SnapshotCache, istio: IstioObjects, api: KubeApi, metrics: Metrics,
                 resync_s: float) -> None:
        self.cache, self.istio, self.api, self.metrics = cache, istio, api, metrics
        self.resource = KUBE_RESOURCES[istio.kind]
        self.namespace = istio.namespace
        self.resync_s = resync_s
        self.applied_version = 0
        self.conflicts: list[str] = []  # names someone else's objects hold (not touched)
        self._wake = asyncio.Event()
        self._desired = SnapshotMemo(self._build)
        self._said = ""  # the last skip message logged (logged once, not every resync)
        self._said_owner = ""
        self._task: asyncio.Task[None] | None = None

    def _build(self, snap: Snapshot) -> dict[str, Obj]:
        objs = [extensions.kube_object(o, namespace=self.namespace, version=snap.version, revision=self.istio.revision)
                for o in self.istio.build(snap.plugin_config())]
        return {o["metadata"]["name"]: o for o in objs}

    def _say(self, message: str) -> None:
        if message != self._said:
            log.warning("%s", message)
            self._said = message

    async def _owner(self) -> Obj | None:
        """The writer's Role (the owner of every object), None when this process may not read it.
        Raises OwnerGone when it does not exist: the install is being removed (the objects go with
        it), so nothing is written, which could otherwise strip their owner and keep them."""
        try:
            role = await self.api.get(extensions.role_path(self.namespace))
        except KubeError as exc:
            if exc.status != 403:
                raise
            self._say_owner(f"may not read Role {self.namespace}/{extensions.WRITER_ROLE}: the {self.istio.kind}s "
                            "are written without an owner and stay when meshcache is uninstalled (delete them by "
                            "label)")
            return None
        if role is None:
            raise OwnerGone(f"Role {self.namespace}/{extensions.WRITER_ROLE} does not exist (meshcache being "
                            f"uninstalled?): not writing; its {self.istio.kind}s go with it")
        self._say_owner("")
        return role

    def _say_owner(self, message: str) -> None:
        if message and message != self._said_owner:
            log.warning("%s", message)
        self._said_owner = message

    async def reconcile(self) -> bool:
        """One pass for the current snapshot; True when the API server holds it (conflicts aside)."""
        snap = self.cache.current
        if not servable(snap):
            self._say("no snapshot loaded yet: the Istio objects in the API server are left as they are")
            self.metrics.kube_passes.labels("no_snapshot").inc()
            return False
        try:
            owner = await self._owner()
        except OwnerGone as exc:
            self._say(str(exc))
            self.metrics.kube_passes.labels("no_owner").inc()
            return False
        desired = {name: with_owner(o, owner) for name, o in self._desired(snap).items()}
        listed = {o["metadata"]["name"]: o for o in await self.api.list(self.resource.path(self.namespace), SELECTOR)}
        mine = {name: o for name, o in listed.items() if ours(o)}
        newest = max((version_of(o) for o in mine.values()), default=0)
        if newest > snap.version:
            self._say(f"the API server has {self.istio.kind}s of snapshot {newest}, newer than this replica's "
                      f"{snap.version}: not writing (another replica is ahead, or this one has not caught up)")
            self.metrics.kube_passes.labels("behind").inc()
            return False
        conflicts = []
        for name, obj in desired.items():
            path = self.resource.path(self.namespace, name)
            current = mine.get(name)
            if current is None:
                other = listed.get(name) or await self.api.get(path)
                if other is not None and ours(other):  # ours, its label removed by hand: put back
                    current = other
                elif other is not None:  # same name, someone else's: never overwritten
                    managers = sorted({m.get("manager", "?") for m in other["metadata"].get("managedFields") or []})
                    conflicts.append(f"{name} (managers: {', '.join(managers) or 'none'})")
                    continue
                else:
                    await self.api.apply(path, obj, FIELD_MANAGER, force=False)
                    self.metrics.kube_writes.labels("create").inc()
                    continue
            if not unchanged(current, obj):
                body = {**obj, "metadata": {**obj["metadata"],
                                            "resourceVersion": current["metadata"]["resourceVersion"]}}
                await self.api.apply(path, body, FIELD_MANAGER, force=True)
                self.metrics.kube_writes.labels("apply").inc()
        for name, current in mine.items():
            if name not in desired:
                if await self.api.delete(self.resource.path(self.namespace, name),
                                         current["metadata"]["resourceVersion"]):
                    log.info("deleted %s %s/%s (no longer in snapshot %d)", self.istio.kind, self.namespace, name,
                             snap.version)
                    self.metrics.kube_writes.labels("delete").inc()
        if conflicts:
            self._say(f"{self.istio.kind} {', '.join(conflicts)} in {self.namespace} exist and were not created by "
                      f"{FIELD_MANAGER}: left alone (delete them to let the control plane write its own)")
        elif self._said:
            log.info("%s %s holds snapshot %d", self.istio.kind, self.namespace, snap.version)
            self._said = ""
        self.conflicts = conflicts
        self.metrics.kube_conflicts.set(len(conflicts))
        if snap.version != self.applied_version:
            self.metrics.kube_apply_latency.observe(max(0.0, time.time() - self.cache.updated_at))
        self.applied_version = snap.version
        self.metrics.kube_applied_version.set(snap.version)
        self.metrics.kube_passes.labels("written").inc()
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="kube-writer")
        log.info("delivery kube: %ss in namespace %s via %s", self.istio.kind, self.namespace, self.api.conn.source)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.api.close()

    async def run(self) -> None:
        watch_id = self.cache.watch(lambda _snap: self._wake.set())
        backoff = BACKOFF_MIN_S
        try:
            while True:
                self._wake.clear()
                try:
                    await self.reconcile()
                    backoff = BACKOFF_MIN_S
                except Exception as exc:  # noqa: BLE001 - the writer outlives any one bad pass
                    # Nothing was deleted because of this: the next pass starts from a fresh list.
                    status = str(exc.status) if isinstance(exc, KubeError) else type(exc).__name__
                    self.metrics.kube_errors.labels(status).inc()
                    self.metrics.kube_passes.labels("error").inc()
                    log.warning("writing %ss to %s failed (%s); retrying in %.1f s", self.istio.kind,
                                self.api.conn.source, exc, backoff, exc_info=not isinstance(exc, KubeError))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), self.resync_s)
                except TimeoutError:
                    pass
        finally:
            self.cache.unwatch(watch_id)
