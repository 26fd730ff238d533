"""A small EnvoyFilter patch applier, written from Istio's documented EnvoyFilter semantics
(istio.io EnvoyFilter reference; the 1.30 behaviour read in pilot/pkg/networking/core/envoyfilter):

- patch sets are applied in ascending (priority, creation time, namespace/name); the patches of one
  set in list order;
- `SIDECAR_INBOUND` patches touch the inbound listener `virtualInbound` only; `ANY` every listener;
- `listener.portNumber`: on virtualInbound, the filter chain's `destination_port`;
  `filterChain.filter.name`: the network filter (HCM); `subFilter.name`: the HTTP filter a relative
  operation is anchored on; an HTTP_FILTER patch whose anchor is absent is not applied;
- HTTP_FILTER: ADD appends, INSERT_FIRST prepends, INSERT_BEFORE/AFTER next to the anchor, REMOVE;
- HTTP_ROUTE: `routeConfiguration.portNumber` is parsed from the route config name
  (`inbound|<port>||`), `name` must equal it, `vhost.name` the virtual host; without a route match
  INSERT_FIRST/INSERT_BEFORE prepend and ADD/INSERT_AFTER append;
- EXTENSION_CONFIG ADD: the value (a TypedExtensionConfig) becomes an ECDS resource istiod serves
  by name over ADS.
Only the operations meshcache uses, plus REMOVE, are implemented; anything else is an error, never
silently ignored.
"""

from __future__ import annotations

import copy
import re
from typing import Any

Obj = dict[str, Any]
VIRTUAL_INBOUND = "virtualInbound"
HCM = "envoy.filters.network.http_connection_manager"


class UnsupportedPatch(ValueError):
    pass


def _ordered(envoy_filters: list[Obj]) -> list[Obj]:
    # Creation time is not known here: the objects' order stands in for it.
    indexed = list(enumerate(envoy_filters))
    indexed.sort(key=lambda p: (p[1]["spec"].get("priority", 0), p[0],
                                f"{p[1]['metadata'].get('namespace', '')}/{p[1]['metadata']['name']}"))
    return [ef for _, ef in indexed]


def _route_config_port(name: str) -> int | None:
    m = re.match(r"^inbound\|(\d+)\|", name)
    return int(m.group(1)) if m else None


def _hcms(listener: Obj, match: Obj) -> list[Obj]:
    """The HCM configs of the listener's filter chains that `match.listener` selects."""
    lmatch = match.get("listener", {})
    if lmatch.get("name") and lmatch["name"] != listener["name"]:
        return []
    out = []
    listen = listener.get("address", {}).get("socket_address", {}).get("port_value")
    for chain in listener.get("filter_chains", []):
        # virtualInbound's chains match a destination port; an outbound listener is the port.
        port = chain.get("filter_chain_match", {}).get("destination_port", listen)
        if lmatch.get("portNumber") and port != lmatch["portNumber"]:
            continue
        fc = lmatch.get("filterChain", {})
        if fc.get("name") and fc["name"] != chain.get("name"):
            continue
        for f in chain.get("filters", []):
            wanted = fc.get("filter", {}).get("name")
            if f["name"] == HCM and wanted in (None, HCM):
                out.append(f["typed_config"])
            elif wanted is not None and wanted != HCM and f["name"] == wanted:
                raise UnsupportedPatch(f"HTTP_FILTER patches on network filter {wanted!r}")
    return out


def _patch_http_filters(hcm: Obj, patch: Obj, anchor: str | None) -> bool:
    filters, op, value = hcm["http_filters"], patch["operation"], patch.get("value")
    at = next((i for i, f in enumerate(filters) if f["name"] == anchor), None) if anchor else None
    if op == "ADD":
        filters.append(copy.deepcopy(value))
    elif op == "INSERT_FIRST":
        filters.insert(0, copy.deepcopy(value))
    elif op in ("INSERT_BEFORE", "INSERT_AFTER"):
        if anchor is None:
            raise UnsupportedPatch(f"{op} without a subFilter to anchor on")
        if at is None:
            return False
        filters.insert(at if op == "INSERT_BEFORE" else at + 1, copy.deepcopy(value))
    elif op == "REMOVE":
        if at is None:
            return False
        del filters[at]
    else:
        raise UnsupportedPatch(f"HTTP_FILTER {op}")
    return True


def _patch_routes(route_config: Obj, match: Obj, patch: Obj) -> bool:
    rmatch = match.get("routeConfiguration", {})
    if rmatch.get("name") and rmatch["name"] != route_config["name"]:
        return False
    if rmatch.get("portNumber") and rmatch["portNumber"] != _route_config_port(route_config["name"]):
        return False
    applied = False
    vmatch = rmatch.get("vhost", {})
    if vmatch.get("route"):
        raise UnsupportedPatch("HTTP_ROUTE anchored on a route")
    for vhost in route_config["virtual_hosts"]:
        if vmatch.get("name") and vmatch["name"] != vhost["name"]:
            continue
        op, value = patch["operation"], copy.deepcopy(patch.get("value"))
        if op in ("INSERT_FIRST", "INSERT_BEFORE"):
            vhost["routes"].insert(0, value)
        elif op in ("ADD", "INSERT_AFTER"):
            vhost["routes"].append(value)
        else:
            raise UnsupportedPatch(f"HTTP_ROUTE {op}")
        applied = True
    return applied


def apply(config: Obj, envoy_filters: list[Obj], context: str = "SIDECAR_INBOUND") -> tuple[Obj, dict[str, Obj], int]:
    """(patched copy of the static listeners/clusters config, ECDS resources by name, patches that
    applied somewhere). `config` is a bootstrap whose static listeners hold istiod's LDS output."""
    out = copy.deepcopy(config)
    listeners = out["static_resources"]["listeners"]
    ecds: dict[str, Obj] = {}
    applied = 0
    for ef in _ordered(envoy_filters):
        for p in ef["spec"]["configPatches"]:
            match, patch = p.get("match", {}), p["patch"]
            if match.get("context", "ANY") not in ("ANY", context):
                continue
            if p["applyTo"] == "EXTENSION_CONFIG":
                if patch["operation"] != "ADD":
                    raise UnsupportedPatch(f"EXTENSION_CONFIG {patch['operation']}")
                ecds[patch["value"]["name"]] = copy.deepcopy(patch["value"])
                applied += 1
                continue
            hit = False
            for listener in listeners:
                if context == "SIDECAR_INBOUND" and listener["name"] != VIRTUAL_INBOUND:
                    continue
                for hcm in _hcms(listener, match):
                    if p["applyTo"] == "HTTP_FILTER":
                        anchor = match.get("listener", {}).get("filterChain", {}).get("filter", {}).get(
                            "subFilter", {}).get("name")
                        hit |= _patch_http_filters(hcm, patch, anchor)
                    elif p["applyTo"] == "HTTP_ROUTE":
                        if "route_config" not in hcm:
                            raise UnsupportedPatch("HTTP_ROUTE on an RDS route (inbound routes are inline)")
                        hit |= _patch_routes(hcm["route_config"], match, patch)
                    else:
                        raise UnsupportedPatch(f"applyTo {p['applyTo']}")
            applied += hit
    return out, ecds, applied
