// pdserve dashboard: polls /metrics, keeps ten minutes of history, draws canvas charts.
// No dependencies; everything it reads is a metric the server exports (see __init__.py).
"use strict";

const POLL_MS = 2000;
const HISTORY = 300; // snapshots kept (10 min at 2 s)
const WINDOW_S = 30; // rates and quantiles over the last 30 s
const COLORS = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a", "#c62828", "#00838f", "#827717"];
const history = []; // [{t: seconds, samples: [{name, labels, value}]}]

function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([^\s{]+)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    samples.push({ name: m[1], labels, value: parseFloat(m[3]) });
  }
  return samples;
}

function select(snapshot, name, filter = {}) {
  return snapshot.samples.filter(
    (s) => s.name === name && Object.entries(filter).every(([k, v]) => s.labels[k] === v));
}

function sum(snapshot, name, filter) {
  return select(snapshot, name, filter).reduce((a, s) => a + s.value, 0);
}

function windowStart(i) {
  const end = history[i];
  let j = i;
  while (j > 0 && end.t - history[j - 1].t <= WINDOW_S) j--;
  return j === i ? null : history[j];
}

function rate(i, name, filter) {
  const start = windowStart(i);
  if (!start) return null;
  const delta = sum(history[i], name, filter) - sum(start, name, filter);
  return Math.max(0, delta) / (history[i].t - start.t);
}

// histogram_quantile over the window: bucket count deltas, linear inside the bucket
function quantile(i, name, q) {
  const start = windowStart(i);
  if (!start) return null;
  const buckets = new Map();
  for (const s of select(history[i], name + "_bucket")) buckets.set(s.labels.le, s.value);
  for (const s of select(start, name + "_bucket")) buckets.set(s.labels.le, buckets.get(s.labels.le) - s.value);
  const sorted = [...buckets.entries()]
    .map(([le, count]) => [le === "+Inf" ? Infinity : parseFloat(le), count])
    .sort((a, b) => a[0] - b[0]);
  const total = sorted.length ? sorted[sorted.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0, below = 0;
  for (const [upper, count] of sorted) {
    if (count >= rank) {
      if (upper === Infinity) return lower;
      return lower + (upper - lower) * ((rank - below) / Math.max(count - below, 1e-9));
    }
    lower = upper; below = count;
  }
  return lower;
}

function series(label, fn) {
  const points = [];
  history.forEach((snap, i) => { const v = fn(i); if (v !== null && isFinite(v)) points.push([snap.t, v]); });
  return { label, points };
}

function gaugeValue(i, name, worker) {
  const found = select(history[i], name, { worker });
  return found.length ? found[0].value : null;
}

function counterRate(i, name, worker) {
  return rate(i, name, { worker });
}

// speculative decoding: the share of a worker's draft tokens that stood, over the window
// (null while it checked none: prefill workers, or no --speculative-config)
function acceptanceRate(i, name, worker) {
  const drafted = rate(i, name, { worker });
  const accepted = rate(i, "pdserve:spec_decode_num_accepted_tokens_total", { worker });
  return drafted ? accepted / drafted : null;
}

// one line per worker: a gauge's value (or, with counterRate, a counter's rate) over time
function workerSeries(name, valueAt = gaugeValue) {
  const last = history[history.length - 1];
  const workers = select(last, name).map((s) => s.labels.worker).sort();
  return workers.map((w) => series(w, (i) => valueAt(i, name, w)));
}

function drawChart(id, lines, refs = []) {
  const canvas = document.getElementById(id);
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 48, R = 8, T = 8, B = 36;
  ctx.clearRect(0, 0, W, H);
  const all = lines.flatMap((l) => l.points);
  const t1 = history.length ? history[history.length - 1].t : 1;
  const t0 = Math.max(history.length ? history[0].t : 0, t1 - HISTORY * POLL_MS / 1000);
  let ymax = Math.max(1e-9, ...all.map((p) => p[1]), ...refs.map((r) => r.value));
  ymax *= 1.1;
  const x = (t) => L + (W - L - R) * ((t - t0) / Math.max(t1 - t0, 1));
  const y = (v) => H - B - (H - T - B) * (v / ymax);
  ctx.strokeStyle = "#ccd"; ctx.fillStyle = "#555"; ctx.font = "11px sans-serif"; ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = (ymax * k) / 4;
    ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(W - R, y(v)); ctx.stroke();
    ctx.fillText(v < 10 ? v.toPrecision(2) : v.toFixed(0), 2, y(v) + 4);
  }
  refs.forEach((r) => {
    ctx.save(); ctx.setLineDash([6, 4]); ctx.strokeStyle = "#b3261e"; ctx.lineWidth = 1.5;
    ctx.beginPath(); ctx.moveTo(L, y(r.value)); ctx.lineTo(W - R, y(r.value)); ctx.stroke();
    ctx.fillStyle = "#b3261e"; ctx.fillText(r.label, W - R - 60, y(r.value) - 4); ctx.restore();
  });
  lines.forEach((line, n) => {
    ctx.strokeStyle = COLORS[n % COLORS.length]; ctx.lineWidth = 2; ctx.beginPath();
    line.points.forEach(([t, v], k) => (k ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
    ctx.fillStyle = COLORS[n % COLORS.length];
    ctx.fillText(line.label, L + 4 + 90 * n, H - 10);
  });
  canvas.dataset.points = String(all.length); // for tests: how many points are drawn
}

function advice(latest) {
  const last = history.length - 1;
  const ttftSlo = sum(latest, "pdserve:slo_target_seconds", { slo: "ttft" });
  const tpotSlo = sum(latest, "pdserve:slo_target_seconds", { slo: "tpot" });
  const ttft = quantile(last, "pdserve:time_to_first_token_seconds", 0.9);
  const itl = quantile(last, "pdserve:inter_token_latency_seconds", 0.9);
  const prefillWaiting = sum(latest, "pdserve:num_requests_waiting", { role: "prefill" });
  const decodeKv = Math.max(0, ...select(latest, "pdserve:kv_cache_usage_perc", { role: "decode" }).map((s) => s.value));
  const notes = [];
  if (ttft !== null && ttft > ttftSlo)
    notes.push(prefillWaiting > 0
      ? "TTFT p90 is over its SLO while prefill queues grow: add prefill workers."
      : "TTFT p90 is over its SLO: check the prefill pool and the routing policy.");
  if (itl !== null && itl > tpotSlo)
    notes.push(decodeKv > 0.9
      ? "Inter-token latency p90 is over the TPOT SLO and decode KV is nearly full: add decode workers."
      : "Inter-token latency p90 is over the TPOT SLO: the decode batches are too large; add decode workers.");
  // out of the prompts sent to the cluster: refused requests (429, 400, 401) place none
  const backlog = rate(last, "pdserve:local_prefills_total", { reason: "backlog" });
  const prompts = rate(last, "pdserve:prompts_total");
  if (backlog !== null && prompts > 0 && backlog >= 0.1 * prompts)
    notes.push(`Decode workers prefilled ${Math.round(100 * Math.min(1, backlog / prompts))}% ` +
      "of the prompts over the last 30 s because the prefill pool was backed up: add prefill workers.");
  const restarted = restartsSince(history[0], latest); // over the history kept (10 min)
  if (restarted.length) {
    const minutes = Math.max(1, Math.round((latest.t - history[0].t) / 60));
    notes.push(`Workers restarted in the last ${minutes} min: ` +
      restarted.map((r) => `${r.slot} (${r.count})`).join(", ") +
      ": their processes died; see those workers' logs.");
  }
  const box = document.getElementById("advice");
  box.innerHTML = "";
  const p = document.createElement("span");
  p.className = notes.length ? "warn" : "ok";
  p.textContent = notes.length ? notes.join(" ") : "Within SLOs (p90 over the last 30 s).";
  box.appendChild(p);
}

// slots whose worker was restarted between two snapshots, with how many times
function restartsSince(start, end) {
  return select(end, "pdserve:worker_restarts_total").map((s) => ({
    slot: s.labels.slot,
    count: s.value - sum(start, "pdserve:worker_restarts_total", { slot: s.labels.slot }),
  })).filter((r) => r.count > 0);
}

function render() {
  const latest = history[history.length - 1];
  const alive = (role) => sum(latest, "pdserve:worker_alive", { role });
  const restarts = sum(latest, "pdserve:worker_restarts_total");
  const switches = sum(latest, "pdserve:role_switches_total");
  document.getElementById("pools").textContent =
    `pools: ${alive("prefill")} prefill · ${alive("decode")} decode` +
    (restarts ? ` · ${restarts} worker restart${restarts === 1 ? "" : "s"} since start` : "") +
    (switches ? ` · ${switches} role switch${switches === 1 ? "" : "es"} (--rebalance)` : "");
  const slo = (name) => sum(latest, "pdserve:slo_target_seconds", { slo: name });
  const quantiles = (name) => [0.5, 0.9, 0.99].map((q) =>
    series(`p${Math.round(q * 100)}`, (i) => quantile(i, name, q)));
  drawChart("ttft", quantiles("pdserve:time_to_first_token_seconds"), [{ label: "SLO", value: slo("ttft") }]);
  drawChart("itl", quantiles("pdserve:inter_token_latency_seconds"), [{ label: "SLO", value: slo("tpot") }]);
  drawChart("throughput", [
    series("tokens/s", (i) => rate(i, "pdserve:generation_tokens_total")),
    series("ok req/s", (i) => rate(i, "pdserve:requests_total", { status: "ok" })),
    series("goodput req/s", (i) => rate(i, "pdserve:slo_met_total")),
  ]);
  drawChart("waiting", workerSeries("pdserve:num_requests_waiting"));
  drawChart("running", workerSeries("pdserve:num_requests_running"));
  drawChart("kv", workerSeries("pdserve:kv_cache_usage_perc"));
  drawChart("transfer", [series("GB/s", (i) => {
    const r = rate(i, "pdserve:kv_transfer_bytes_total", { role: "prefill" });
    return r === null ? null : r / 1e9;
  })]);
  drawChart("prefill", workerSeries("pdserve:worker_prefill_tokens_total", counterRate));
  drawChart("spec", workerSeries("pdserve:spec_decode_num_draft_tokens_total", acceptanceRate)
    .filter((line) => line.points.length));
  const median = (label, name) => series(label, (i) => quantile(i, name, 0.5));
  drawChart("prediction", [
    median("TTFT", "pdserve:time_to_first_token_seconds"),
    median("TTFT predicted", "pdserve:predicted_time_to_first_token_seconds"),
    median("TPOT", "pdserve:time_per_output_token_seconds"),
    median("TPOT predicted", "pdserve:predicted_time_per_output_token_seconds"),
  ]);
  drawChart("refusals", ["ttft", "tpot", "warming_up", "fair_share"].map((reason) =>
    series(reason, (i) => rate(i, "pdserve:admission_refusals_total", { reason }))));
  drawChart("poolsizes", ["prefill", "decode"].map((role) =>
    series(role, (i) => sum(history[i], "pdserve:worker_alive", { role }))));
  advice(latest);
}

async function poll() {
  const key = sessionStorage.getItem("pdserve-api-key") || "";
  const status = document.getElementById("status");
  try {
    const response = await fetch("/metrics", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    if (response.status === 401) {
      document.getElementById("login").hidden = false;
      status.textContent = "API key needed"; status.className = "error";
      return;
    }
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    history.push({ t: Date.now() / 1000, samples: parseMetrics(await response.text()) });
    if (history.length > HISTORY) history.shift();
    status.textContent = `updated ${new Date().toLocaleTimeString()}`; status.className = "";
    render();
  } catch (error) {
    status.textContent = String(error); status.className = "error";
  }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("pdserve-api-key", document.getElementById("key").value);
  document.getElementById("login").hidden = true;
  poll();
});
poll();
setInterval(poll, POLL_MS);
