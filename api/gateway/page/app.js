// mlxq's dashboard: polls the gateway's /dashboard/api once a second and draws the fleet. Everything from jobs
// goes into the page as text (textContent, never innerHTML); the key lives in this tab's sessionStorage and
// goes out as an Authorization header.
"use strict";

const POLL_MS = 1000;
const KEY = "mlxq-dashboard-key";
const $ = (id) => document.getElementById(id);
let timer = null;
let admin = false;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell === null || cell === undefined ? "-" : String(cell);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows, empty, columns) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows);
  if (!rows.length) {
    const td = el("td", empty, "empty");
    td.colSpan = columns;
    const tr = document.createElement("tr");
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

const ms = (v) => (v === null || v === undefined || v === false ? "-" : v >= 1000 ? (v / 1000).toFixed(2) + " s" : Math.round(v) + " ms");
const age = (s) => (s === null || s === undefined ? "-" : s < 60 ? s.toFixed(1) + " s" : s < 3600 ? Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s" : Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m");
const when = (epochS) => new Date(epochS * 1000).toLocaleTimeString();

function jobLink(id) {
  const a = el("a", id, "job");
  a.href = "#/job/" + encodeURIComponent(id);
  return a;
}

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, options) {
  const response = await fetch("/dashboard/api/" + path, { ...(options || {}), headers: { ...headers(), "content-type": "application/json" } });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error((body.error && body.error.message) || response.status + " " + response.statusText);
  return body;
}

function status(text, bad) {
  $("status").textContent = text;
  $("status").className = bad ? "error" : "";
}

// --- charts: small SVG sparklines, one series per line --------------------------------------------------
// A line joins the buckets that have a value (a percentile has none where no job ended), a lone one is a dot.
function spark(values, extra) {
  const w = 120, h = 28, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  const series = [values, ...(extra ? [extra] : [])];
  const top = Math.max(1e-9, ...series.flat().filter((v) => v !== null));
  series.forEach((vals, i) => {
    const points = vals.map((v, x) => (v === null ? null : [(x * (w - 2)) / Math.max(1, vals.length - 1) + 1, h - 2 - ((h - 4) * v) / top])).filter((p) => p !== null);
    const line = document.createElementNS(ns, points.length === 1 ? "circle" : "polyline");
    if (points.length === 1) {
      line.setAttribute("cx", points[0][0].toFixed(1));
      line.setAttribute("cy", points[0][1].toFixed(1));
      line.setAttribute("r", "1.5");
    } else line.setAttribute("points", points.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" "));
    if (i === 1) line.setAttribute("class", "p99");
    svg.appendChild(line);
  });
  return svg;
}

// The buckets a model's charts show: from its first with a job ended in the window (at least the last minute),
// so a few minutes of jobs fill the chart rather than its last pixels.
function shown(points) {
  const first = points.findIndex((p) => p.jobs_per_s > 0 || p.errors > 0);
  return points.slice(first < 0 ? points.length - 6 : Math.min(first, points.length - 6));
}

function chartCell(label, values, extra) {
  const box = el("div", null, "cell-chart");
  box.appendChild(el("span", label));
  box.appendChild(spark(values, extra));
  return box;
}

function last(points, field) {
  for (let i = points.length - 1; i >= 0; i--) if (points[i][field] !== null) return points[i][field];
  return null;
}

function mean(points, field) {
  const recent = points.slice(-6);  // the last minute
  return recent.reduce((sum, p) => sum + p[field], 0) / Math.max(1, recent.length);
}

function bytes(n) {  // 1,536 -> "1.5 KiB"
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

// --- views ---------------------------------------------------------------------------------------------
function drawOverview(data) {
  fill("models", data.models.map((m) => {
    const h = shown(m.history), s = m.served;
    const prio = Object.entries(m.by_priority).map(([p, n]) => "p" + p + ": " + n).join(", ") || "-";
    const name = m.band === "bulk" ? m.name.slice(0, -"~bulk".length) + " (bulk)" : m.name;
    const workers = s ? (s.workers || (s.loadable ? "loadable on " + s.loadable : 0)) : 0;  // loaded on demand
    return row([name, m.queued, prio, age(m.oldest_s), workers,
      s ? s.running + " / " + s.capacity : "-", s ? s.tokens_per_s.toFixed(1) : "-",
      chartCell(mean(h, "jobs_per_s").toFixed(2), h.map((p) => p.jobs_per_s)),
      chartCell(mean(h, "tokens_per_s").toFixed(1), h.map((p) => p.tokens_per_s)),
      chartCell(ms(last(h, "ttft_p50")) + " / " + ms(last(h, "ttft_p99")), h.map((p) => p.ttft_p50), h.map((p) => p.ttft_p99)),
      chartCell(ms(last(h, "wait_p50")) + " / " + ms(last(h, "wait_p99")), h.map((p) => p.wait_p50), h.map((p) => p.wait_p99))]);
  }), "no queued jobs and no live workers", 11);
  drawTenants(data.tenants || []);
  const rows = [];
  for (const w of data.workers) {
    const used = w.models.reduce((n, m) => n + m.running, 0), cap = w.models.reduce((n, m) => n + m.capacity, 0);
    const state = w.draining ? "draining" : w.models.map((m) => m.state).join(", ");
    const spec = w.models.filter((m) => m.speculation).map((m) => m.speculation + (m.drafted ? " " + Math.round((100 * m.accepted) / m.drafted) + "% taken" : "")).join(", ") || "-";
    const kv = w.models.reduce((n, m) => n + (m.kv_bytes || 0), 0);
    const room = w.models.reduce((n, m) => n + (m.kv_headroom_bytes || 0), 0);
    const hits = w.models.reduce((n, m) => n + (m.prefix_hits || 0), 0);
    const looks = hits + w.models.reduce((n, m) => n + (m.prefix_misses || 0), 0);
    const disk = prefixDisk(w.models);
    const devices = [...new Set(w.models.map((m) => m.device).filter(Boolean))].join(", ") || "-";
    rows.push(row([w.id, w.host + " (pid " + w.pid + ")", state, w.models.map((m) => m.name).join(", "), used + " / " + cap,
      w.models.reduce((n, m) => n + m.waiting, 0), w.models.reduce((n, m) => n + m.tokens_per_s, 0).toFixed(1),
      room ? bytes(kv) + " / " + bytes(room) : "-",
      (looks ? Math.round((100 * hits) / looks) + "% of " + looks : "-") + disk,
      spec, devices, w.version, age(data.at - w.updated_at) + " ago"]));
  }
  for (const w of data.lost) {
    const tr = row([w.id, "-", "lost", "-", "-", "-", "-", "-", "-", "-", "-", "-", age(data.at - w.last_seen) + " ago"]);
    tr.className = "lost";
    rows.push(tr);
  }
  fill("workers", rows, "no workers", 13);
  drawWebhooks(data.webhooks || {});
}

// Shown once the deployment has sent (or meant to send) a webhook event: counters, endpoints a 410 disabled,
// deliveries given up.
function drawWebhooks(hooks) {
  const counts = hooks.counts || {}, disabled = hooks.disabled || [], failures = hooks.failures || [];
  const used = Object.keys(counts).length || hooks.waiting || disabled.length || failures.length;
  $("webhooks").hidden = !used;
  $("webhooks-summary").textContent = used ? (counts.delivered || 0) + " delivered, " + (counts.retried || 0) +
    " retried, " + (counts.failed || 0) + " given up, " + (counts.disabled || 0) + " endpoint 410s; " +
    (hooks.waiting || 0) + " events waiting" : "";
  const stamp = (atMs) => new Date(atMs).toLocaleString();
  fill("webhook-disabled", disabled.map((d) => row([d.url, stamp(d.at_ms), d.event || "-"])),
    "no endpoint answered 410 Gone", 3);
  fill("webhook-failures", failures.map((f) => row([f.url, f.type, f.id, f.event, f.attempts || "-", f.error,
    stamp(f.at_ms)])), "no delivery was given up", 7);
}

function prefixDisk(models) {  // the tier on disk: ", disk: 3 hits, 120 MiB in 40" (nothing without one)
  const sum = (f) => models.reduce((n, m) => n + (m[f] || 0), 0);
  const hits = sum("prefix_disk_hits"), entries = sum("prefix_disk_entries"), errors = sum("prefix_disk_errors");
  if (!hits && !entries && !sum("prefix_disk_writes")) return "";
  return ", disk: " + hits + " hits, " + bytes(sum("prefix_disk_bytes")) + " in " + entries +
    (errors ? ", " + errors + " unreadable" : "");
}

function drawTenants(tenants) {
  const active = tenants.filter((t) => t.queued || t.running);
  const weights = active.reduce((n, t) => n + t.policy.weight, 0);
  const capped = (n, cap) => (cap ? n + " / " + cap : String(n));
  fill("tenants", tenants.map((t) => row([t.name + (t.named ? "" : " *"), String(t.policy.weight),
    capped(t.queued, t.policy.max_queued), capped(t.running, t.policy.max_running),
    capped(Math.round(t.tokens_per_minute), t.policy.tokens_per_minute), Math.round(100 * t.share) + "%",
    (t.queued || t.running) && weights ? Math.round((100 * t.policy.weight) / weights) + "%" : "-"])),
  "no tenant has a policy or jobs", 7);
}

function stateCell(state) {
  return el("span", state, "state-" + state);
}

function cancelButton(id) {
  const b = el("button", "Cancel", "danger");
  b.type = "button";
  b.dataset.job = id;
  b.addEventListener("click", () => cancel(id));
  return b;
}

function drawJobs(data) {
  fill("running", data.running.map((j) => row([jobLink(j.id), j.model, stateCell(j.state), j.worker || "-",
    admin ? cancelButton(j.id) : ""])), "no running jobs", 5);
  fill("recent", data.recent.map((j) => row([jobLink(j.id), j.model, j.tenant || "-", stateCell(j.type), ms(j.ttft_ms),
    ms(j.queue_ms), (j.prompt_tokens === false ? "-" : j.prompt_tokens) + " / " + (j.completion_tokens === false ? "-" : j.completion_tokens),
    ms(j.total_ms), j.reason, when(j.at_ms / 1000)])), "no job ended lately", 10);
}

function drawDead(data) {
  fill("dead", data.dead.map((d) => {
    let action = "";
    if (admin) {
      action = el("button", "Retry");
      action.type = "button";
      action.addEventListener("click", () => retry(d.hex));
    }
    return row([d.entry, d.queue, d.reason, when(d.at_ms / 1000), d.worker, action]);
  }), "no dead letters", 6);
}

function clearData() {
  for (const table of document.querySelectorAll("main table")) table.tBodies[0].replaceChildren();
  $("webhooks-summary").textContent = "";
  $("webhooks").hidden = true;
  clearJob("");
}

function clearJob(id) {
  $("job-id").textContent = id;
  $("job-cancel").hidden = true;
  for (const part of ["job-facts", "job-request", "job-output"]) $(part).replaceChildren();
  $("job-events").tBodies[0].replaceChildren();
}

function drawJob(job) {
  $("job-id").textContent = job.id;
  ended = (job.state === "done" || job.state === "error") && job.summary ? job.id : null;
  $("job-cancel").hidden = !(admin && (job.state === "queued" || job.state === "running"));
  const facts = [["State", job.state], ["Tries", job.tries], ["Worker", job.worker || "-"],
    ["Cancel requested", job.cancel_requested ? "yes" : "no"]];
  const s = job.summary;
  if (s) facts.push(["TTFT", ms(s.ttft_ms)], ["Queue wait", ms(s.queue_ms)], ["Duration", ms(s.total_ms)],
    ["Tokens (prompt / out)", s.prompt_tokens + " / " + s.completion_tokens], ["Finish reason", s.reason]);
  if (job.error) facts.push(["Error", job.error.code + ": " + job.error.message]);
  $("job-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
  const req = job.request;
  $("job-request").textContent = req === null ? "(the job's record is gone: it ended)"
    : (job.full ? "" : "(" + req.bytes + " bytes; the prompt is shown to admin keys only)\n") + JSON.stringify(req.payload, null, 2);
  const tokens = job.events.filter((e) => e.type === "token");
  $("job-output").textContent = job.full ? tokens.map((e) => e.text).join("")
    : tokens.reduce((n, e) => n + e.chars, 0) + " characters in " + tokens.length + " events (the output is shown to admin keys only)";
  fill("job-events", job.events.map((e) => {
    const { type, seq, id, ...rest } = e;
    return row([seq, type, JSON.stringify(rest)]);
  }), "no events (yet)", 3);
}

// --- actions -------------------------------------------------------------------------------------------
async function cancel(id) {
  try {
    const r = await api("jobs/" + encodeURIComponent(id) + "/cancel", { method: "POST" });
    status(r.cancel_requested ? "cancel of " + id + " requested" : id + " had ended already");
    refresh();
  } catch (err) {
    status("cancel failed: " + err.message, true);
  }
}

async function retry(hex) {
  try {
    const r = await api("dead/retry", { method: "POST", body: JSON.stringify({ hex }) });
    status("submitted again as " + r.id);
    refresh();
  } catch (err) {
    status("retry failed: " + err.message, true);
  }
}

// --- routing and polling -------------------------------------------------------------------------------
function route() {
  const hash = location.hash.replace(/^#\/?/, "");
  if (hash.startsWith("job/")) return { view: "job", id: decodeURIComponent(hash.slice(4)) };
  return { view: ["jobs", "dead"].includes(hash) ? hash : "overview" };
}

async function refresh() {
  const r = route();
  for (const v of ["overview", "jobs", "dead", "job"]) $("view-" + v).hidden = v !== r.view;
  for (const v of ["overview", "jobs", "dead"]) $("nav-" + v).classList.toggle("active", v === r.view);
  try {
    const session = await api("session");
    admin = session.admin;
    $("role").textContent = !session.reader ? "not signed in" : admin ? "admin" : "read-only";
    for (const id of ["key", "login-button", "logout"]) $(id).hidden = !session.keys_required;  // nobody signs in
    if (!session.reader) {
      clearData();  // never an earlier key's data under a key that reads nothing
      status(sessionStorage.getItem(KEY) ? "that key is not valid here: sign in with another" : "sign in with an API or admin key", true);
      return;
    }
    if (r.view === "job") {
      if ($("job-id").textContent !== r.id) clearJob(r.id);  // never another job's details under this id
      drawJob(await api("jobs/" + encodeURIComponent(r.id)));
      status("job " + r.id + " - updated " + new Date().toLocaleTimeString());
    } else {
      const data = await api("overview");
      drawOverview(data);
      drawJobs(data);
      drawDead(data);
      status("Redis " + data.redis + ", prefix " + data.prefix + " - updated " + when(data.at));
    }
  } catch (err) {
    status(err.message, true);
  }
}

let ended = null;  // the id of the job whose page shows its end: nothing more will change, stop polling it

function schedule() {
  clearTimeout(timer);
  refresh().finally(() => {
    const r = route();
    if (!(r.view === "job" && ended === r.id)) timer = setTimeout(schedule, POLL_MS);
  });
}

function start() {
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key").value.trim();
    if (key) sessionStorage.setItem(KEY, key);
    $("key").value = "";
    schedule();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); schedule(); });
  $("search").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("search-id").value.trim();
    if (id) location.hash = "#/job/" + encodeURIComponent(id);
  });
  $("job-cancel").addEventListener("click", () => cancel(route().id));
  window.addEventListener("hashchange", schedule);
  schedule();
}

document.addEventListener("DOMContentLoaded", start);
