// meshcache status page: reads the control-plane API with the token kept in sessionStorage.
// Every value from the API is inserted as text (never HTML): node ids and NACK errors come
// from proxies and may contain anything.
"use strict";

const TOKEN_KEY = "meshcache.token";
const REFRESH_MS = 5000;
let role = null;
let timer = null;
let armed = null; // the rollback button waiting for its confirming second click

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "title") e.title = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

function fmtInt(n) { return n == null ? "—" : Number(n).toLocaleString("en-US"); }
function fmtBytes(n) {
  if (n == null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}
function fmtTime(t) { return t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "—"; }
function fmtValue(v) { return v == null ? "∅" : (Array.isArray(v) ? "[" + v.join(", ") + "]" : String(v)); }

class ApiError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

async function api(method, path, body) {
  const headers = { "Authorization": "Bearer " + sessionStorage.getItem(TOKEN_KEY) };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                                cache: "no-store" });
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) throw new ApiError(r.status, (data && data.detail) || ("HTTP " + r.status));
  return data;
}

function setMessage(text, isError) {
  const m = $("message");
  m.textContent = text || "";
  m.className = isError ? "error" : "";
}

function fill(tableId, rows) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows);
}

function emptyRow(cols, text) {
  return el("tr", {}, el("td", { colspan: String(cols), class: "muted" }, text));
}

// ---- sections ------------------------------------------------------------------------------

function renderServing(serving) {
  const box = $("serving");
  box.hidden = !serving.degraded;
  box.textContent = serving.degraded ? "Degraded: " + serving.detail + ". Changes are refused (503) until it is back." : "";
}

function renderStats(stats) {
  renderServing(stats.serving);
  const note = $("stats-note");
  const parts = ["Counted by the meshcache filter in each proxy since that Envoy started; sums over "
    + stats.proxies_read + " of " + (stats.proxies_read + stats.proxies_unread) + " proxies."];
  if (!stats.complete) {
    parts.push(" Stats of " + stats.proxies_unread + " proxy(ies) could not be read (see Proxies): "
      + "the sums leave them out.");
  }
  if (stats.unattributed_entries == null) {
    parts.push(stats.proxies_read ? " Entries and bytes per model: unknown (a proxy's filter reports them per proxy"
      + " only, see Proxies)." : "");
  } else {
    parts.push(" Entries and bytes: what each policy holds in the proxies' caches now.");
  }
  note.replaceChildren(el("span", { class: stats.complete ? "" : "warn" }, parts.join("")));
  const other = $("unattributed");
  other.textContent = stats.unattributed_entries
    ? "Not attributed to a current policy (a removed policy's entries, until evicted): "
      + fmtInt(stats.unattributed_entries) + " entries, " + fmtBytes(stats.unattributed_bytes) + "."
    : "";

  fill("models", stats.models.length ? stats.models.map((m) => {
    const ratio = m.hit_ratio == null ? "—" : (m.hit_ratio * 100).toFixed(1) + " %";
    const bar = el("span", { class: "bar" });
    bar.style.width = m.hit_ratio == null ? "0px" : Math.round(m.hit_ratio * 60) + "px";
    const name = el("td", { class: "mono" }, m.model_prefix);
    if (!m.in_policy) name.append(el("span", { class: "muted" }, " (no policy now)"));
    if (m.ambiguous_with.length) {
      name.append(el("span", { class: "warn", title: "stat names collide" },
        " (counted together with " + m.ambiguous_with.join(", ") + ")"));
    }
    return el("tr", { "data-model": m.model_prefix }, name,
      el("td", { class: "num" }, fmtInt(m.hits)), el("td", { class: "num" }, fmtInt(m.misses)),
      el("td", { class: "num hit-ratio" }, ratio, bar),
      el("td", { class: "num entries" }, fmtInt(m.entries)),
      el("td", { class: "num bytes" }, fmtBytes(m.bytes)),
      el("td", { class: "num tokens-prompt" }, fmtInt(m.tokens_saved_prompt)),
      el("td", { class: "num tokens-completion" }, fmtInt(m.tokens_saved_completion)));
  }) : [emptyRow(8, "no policies and no counters yet")]);
  const s = stats.semantic;
  $("semantic").textContent = s
    ? "Semantic layer: " + fmtInt(s.lookups) + " lookups on exact misses, " + fmtInt(s.hits) + " hits served by "
      + "similarity, " + fmtInt(s.would_hit) + " would-be hits in shadow mode, " + fmtInt(s.errors) + " failed lookups."
    : "";
}

function renderProxies(proxies, stats, version) {
  const byNode = new Map(stats.proxies.map((p) => [p.node_id, p]));
  const nodes = [...proxies.proxies.map((p) => p.node_id)];
  for (const s of stats.proxies) if (!nodes.includes(s.node_id)) nodes.push(s.node_id);
  const xds = new Map(proxies.proxies.map((p) => [p.node_id, p]));
  fill("proxies", nodes.length ? nodes.map((node) => {
    const p = xds.get(node);
    const s = byNode.get(node);
    let acked;
    if (!p) acked = el("span", { class: "bad" }, "not connected");
    else if (p.current) acked = el("span", { class: "ok" }, p.acked_version + " ✓ current");
    else acked = el("span", { class: "warn" }, (p.acked_version || "nothing") + " (current is " + version + ")");
    const nack = p && p.last_nack
      ? el("span", { class: "bad", title: "at " + fmtTime(p.last_nack.at) }, "v" + p.last_nack.version + ": "
        + p.last_nack.error)
      : el("span", { class: "muted" }, "none");
    const statCell = !s ? el("span", { class: "muted" }, "—")
      : s.ok ? el("span", { class: "ok", title: s.source }, "read " + fmtTime(s.read_at).slice(11))
        : el("span", { class: "bad", title: s.source || "" }, "unavailable: " + s.error);
    const ok = s && s.ok;
    return el("tr", { "data-node": node }, el("td", { class: "mono" }, node),
      // The resources it asked for say which filter it runs (meshcache-native: the native host).
      el("td", {}, p ? [p.transport, ...(p.resources || [])].join(" · ") : "—"),
      el("td", { class: "acked" }, acked), el("td", { class: "nack" }, nack),
      el("td", { class: "num" }, ok ? fmtInt(s.entries) : "?"),
      el("td", { class: "num" }, ok ? fmtBytes(s.bytes) : "?"),
      el("td", { class: "num" }, ok ? fmtInt(s.hits) : "?"),
      el("td", { class: "num" }, ok ? fmtInt(s.misses) : "?"),
      el("td", { class: "stats" }, statCell));
  }) : [emptyRow(9, "no proxy connected")]);
}

function renderSnapshot(snap) {
  $("snapshot-version").textContent = "(version " + snap.version + ")";
  $("snapshot-meta").textContent = snap.version === 0 ? "Never configured: proxies keep their default config."
    : "Created " + fmtTime(snap.created_at) + " UTC by " + snap.author + ": " + snap.action;
  fill("policies", snap.policies.length ? snap.policies.map((p) => el("tr", { "data-model": p.model_prefix },
    el("td", { class: "mono" }, p.model_prefix), el("td", { class: "num ttl" }, p.ttl_s),
    el("td", { class: "num" }, p.max_ttl_s), el("td", { class: "num" }, p.generation),
    el("td", {}, p.scope), el("td", {}, p.enabled ? "yes" : el("span", { class: "warn" }, "no (bypass)")),
    el("td", { class: "mono" }, p.hash_headers.join(", ")),
    el("td", { class: "mono" }, p.vary_headers.join(", ") || "—"),
    el("td", { class: "num coalesce" }, p.coalesce_timeout_ms || "off"),
    el("td", { class: "num stale-if-error" }, p.stale_if_error_s),
    el("td", { class: "num stale-while-revalidate" }, p.stale_while_revalidate_s),
    el("td", { class: "semantic" }, p.semantic ? "≥ " + p.semantic.threshold + (p.semantic.shadow ? " (shadow)" : "")
      : "off"))) : [emptyRow(12, "no policies")]);
  const l = snap.limits;
  $("limits").textContent = "Limits: max_entry_bytes " + fmtBytes(l.max_entry_bytes) + ", max_total_bytes "
    + fmtBytes(l.max_total_bytes) + ", max_entries " + fmtInt(l.max_entries) + ".";
}

function describeChange(c) {
  if (c.what === "limits") {
    return "limits: " + Object.entries(c.fields).map(([k, v]) => k + " " + fmtValue(v[0]) + " → "
      + fmtValue(v[1])).join(", ");
  }
  if (c.what === "added") return "added " + c.model_prefix + " (ttl_s " + fmtValue(c.fields.ttl_s[1]) + ")";
  if (c.what === "removed") return "removed " + c.model_prefix;
  if (c.what === "purged") return "purged " + c.model_prefix + " (generation " + fmtValue(c.fields.generation[0])
    + " → " + fmtValue(c.fields.generation[1]) + ")";
  return c.model_prefix + ": " + Object.entries(c.fields).map(([k, v]) => k + " " + fmtValue(v[0]) + " → "
    + fmtValue(v[1])).join(", ");
}

function rollbackButton(version, current) {
  const b = el("button", { type: "button", class: "rollback", "data-version": String(version) },
    "Roll back to " + version);
  if (role !== "write") {
    b.disabled = true;
    b.title = "needs a token with role write";
    return b;
  }
  b.addEventListener("click", async () => {
    if (armed !== b) { // first click arms, second confirms: no accidental rollbacks
      if (armed) { armed.classList.remove("confirm"); armed.textContent = "Roll back to " + armed.dataset.version; }
      armed = b;
      b.classList.add("confirm");
      b.textContent = "Confirm: make " + version + "'s policies current";
      return;
    }
    armed = null;
    b.disabled = true;
    try {
      const r = await api("POST", "/v1/rollback", { version: version });
      setMessage(r.changed ? "Rolled back to version " + version + ": now version " + r.version + "."
        : "Version " + version + " has the current policies already: nothing changed.", false);
    } catch (e) {
      setMessage("Rollback to " + version + " failed: " + e.message, true);
    }
    await refresh();
  });
  return b;
}

function renderHistory(hist) {
  fill("history", hist.snapshots.length ? hist.snapshots.map((h) => {
    const changes = h.diff_known
      ? (h.changes.length ? el("ul", { class: "changes" }, ...h.changes.map((c) => el("li", {}, describeChange(c))))
        : el("span", { class: "muted" }, "no policy change"))
      : el("span", { class: "muted" }, "previous version no longer kept");
    const current = h.version === hist.version;
    return el("tr", { "data-version": String(h.version), class: current ? "current" : "" },
      el("td", { class: "num" }, h.version), el("td", {}, fmtTime(h.created_at)), el("td", {}, h.author),
      el("td", { class: "mono" }, h.action), el("td", {}, changes),
      el("td", {}, current ? el("span", { class: "ok" }, "current") : rollbackButton(h.version, hist.version)));
  }) : [emptyRow(6, "no snapshots yet")]);
}

// ---- flow ----------------------------------------------------------------------------------

function showLogin(error) {
  if (timer) { clearInterval(timer); timer = null; }
  $("main").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
  $("refresh").hidden = true;
  $("who").textContent = "";
  $("summary").textContent = "";
  $("login-error").textContent = error || "";
}

async function refresh() {
  try {
    // Stats first: they say whether the control plane is degraded, even when nothing else loads.
    const stats = await api("GET", "/v1/stats");
    renderStats(stats);
    const [snap, proxies] = await Promise.all([api("GET", "/v1/snapshot"), api("GET", "/v1/proxies")]);
    renderSnapshot(snap);
    renderProxies(proxies, stats, snap.version);
    // Older snapshots are read from the store: while it is unreachable the history keeps its last state.
    const hist = stats.serving.degraded ? null : await api("GET", "/v1/snapshots?limit=20");
    if (hist && !armed) renderHistory(hist); // don't pull an armed button from under the user
    const stale = proxies.proxies.filter((p) => !p.current).length;
    const n = proxies.proxies.length;
    // istiod (an MCP client) is no proxy: its ACKed snapshot is shown apart.
    const clients = (proxies.config_clients || []).map((c) => "istiod at version " + (c.acked_version || "none"));
    const degraded = stale || proxies.istiod_error || !stats.complete;
    $("summary").textContent = (degraded ? "DEGRADED · " : "") + "policy version " + snap.version + " · " + n
      + (n === 1 ? " proxy" : " proxies") + (stale ? " (" + stale + " not current)" : "")
      + (clients.length ? " · " + clients.join(", ") : "") + " · updated " + fmtTime(Date.now() / 1000).slice(11);
    $("summary").className = degraded ? "warn" : "";
    if (proxies.istiod_error) setMessage(proxies.istiod_error, true);
    document.body.dataset.version = String(snap.version);
    document.body.dataset.loaded = "1";
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("Token refused: " + e.message);
      return;
    }
    setMessage("Could not refresh: " + e.message, true);
  }
}

async function start() {
  try {
    const me = await api("GET", "/v1/whoami");
    role = me.role;
    $("who").textContent = me.name + " (" + me.role + ")";
  } catch (e) {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(e instanceof ApiError && e.status === 401 ? "Token refused: " + e.message : "Error: " + e.message);
    return;
  }
  $("login").hidden = true;
  $("main").hidden = false;
  $("logout").hidden = false;
  $("refresh").hidden = false;
  await refresh();
  timer = setInterval(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    start();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showLogin(""); });
  $("refresh").addEventListener("click", () => refresh());
  if (sessionStorage.getItem(TOKEN_KEY)) start(); else showLogin("");
});
