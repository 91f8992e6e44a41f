// Octavo's live dashboard: reads /dashboard/events (server-sent snapshots, ~4 a second) with the
// API key from the form (kept for this tab only), draws the block pool, the requests and the last
// steps. Plain JS and canvas; no build step, no library.
"use strict";

const FIXED = { f: "#e6e6e6", c: "#9ec5e8", s: "#333333", p: "#d4a017" };
const $ = (id) => document.getElementById(id);
let snapshot = null;
let cell = { size: 8, cols: 1 };

function colourOf(index) {
  return index < 0 ? "#888" : `hsl(${(index * 137.5) % 360}, 60%, 52%)`;
}

function cellColour(pool, i) {
  const state = pool.cells[i];
  return state === "u" ? colourOf(pool.owners ? pool.owners[i] : -1) : FIXED[state] || "#e6e6e6";
}

// The request whose blocks the pool outlines and whose block table shows: hovered, or clicked
// (kept until clicked again); and the window frees already seen (to flash only new ones).
let selected = { hover: null, pinned: null };
let lastWindowFreed = null;
let freshFrees = [];  // given back by a window since the previous snapshot (kept for redraws on hover)

function cellOf(pool, blockId) {
  return Math.floor(blockId / pool.blocks_per_cell);
}

function heldIds(r) {
  return r.tables.flatMap((t) => t.ids.filter((b) => b !== null));
}

function selectedRow(snap) {
  const seq = selected.hover || selected.pinned;
  return seq ? snap.running.concat(snap.waiting).find((r) => r.seq === seq) || null : null;
}

function newWindowFrees(pool) {
  const wf = pool.window_freed;
  const fresh = lastWindowFreed === null ? 0 : Math.min(wf.recent.length, Math.max(0, wf.total - lastWindowFreed));
  lastWindowFreed = wf.total;
  freshFrees = fresh ? wf.recent.slice(wf.recent.length - fresh) : [];
  return freshFrees;
}

function outline(ctx, i, colour, width, inset = 0) {
  const d = inset + width / 2;
  ctx.strokeStyle = colour;
  ctx.lineWidth = width;
  ctx.strokeRect((i % cell.cols) * cell.size + d, Math.floor(i / cell.cols) * cell.size + d,
    cell.size - 1 - 2 * d, cell.size - 1 - 2 * d);
}

function drawPool(pool, row, freshFrees) {
  const canvas = $("pool");
  const n = pool.cells.length;
  const width = canvas.clientWidth || canvas.width;
  const size = Math.max(3, Math.min(18, Math.floor(Math.sqrt((width * 240) / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(width / size));
  canvas.width = width;
  canvas.height = Math.ceil(n / cols) * size;
  cell = { size, cols };
  canvas.dataset.cells = pool.cells;  // the states drawn, for tests and for whoever inspects the page
  const ctx = canvas.getContext("2d");
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = cellColour(pool, i);
    const x = (i % cols) * size, y = Math.floor(i / cols) * size;
    ctx.fillRect(x, y, size - 1, size - 1);
    if (pool.groups && pool.groups[i] > 0 && size >= 5) {  // a sliding-window layer's block: a light corner
      ctx.fillStyle = "rgba(255,255,255,0.75)";
      ctx.beginPath();
      ctx.moveTo(x + size - 1, y); ctx.lineTo(x + size - 1, y + size / 2); ctx.lineTo(x + size / 2, y);
      ctx.fill();
    }
  }
  freshFrees.forEach((b) => outline(ctx, cellOf(pool, b), "#d62728", 2));
  canvas.dataset.windowFreed = freshFrees.join(",");
  const mine = row ? [...new Set(heldIds(row).map((b) => cellOf(pool, b)))].sort((a, b) => a - b) : [];
  mine.forEach((i) => { outline(ctx, i, "#000", 2); if (size >= 8) outline(ctx, i, "#fff", 1, 2); });  // seen on dark cells too
  canvas.dataset.highlight = mine.join(",");
  const per = pool.blocks_per_cell > 1 ? `, ${pool.blocks_per_cell} blocks a cell` : "";
  const freed = pool.windows.length > 1 ? `; ${pool.window_freed.total} given back by sliding windows` : "";
  $("poolinfo").textContent = `${pool.num_blocks} blocks of ${pool.block_size} tokens${per}; ` +
    Object.entries(pool.counts).map(([k, v]) => `${v} ${k}`).join(", ") + freed;
  $("legend-window").hidden = pool.windows.length < 2;
}

const STATE_NAMES = { f: "free", c: "cached", u: "in use", s: "shared", p: "pinned" };

function groupName(pool, g) {
  const w = pool.windows[g];
  return w === null || w === undefined ? "global layers" : `window ${w}`;
}

function drawTable(snap, row) {
  // the selected request's block table, one strip per KV group: entry = block id, coloured by
  // the block's state; a window's given-back entries hatched
  const panel = $("tablepanel"), pool = snap.pool;
  panel.dataset.seq = row ? row.seq : "";
  if (!row) {
    panel.replaceChildren(Object.assign(document.createElement("p"), { className: "hint",
      textContent: "Hover over a request (click to keep it) to see its block table and outline its blocks in the pool." }));
    return;
  }
  const head = document.createElement("p");
  head.innerHTML = `<span class="swatch" style="background:${colourOf(row.color)}"></span><b>${escape(row.seq)}</b>` +
    ` block table: ${row.num_blocks} blocks held${selected.pinned === row.seq ? " (kept: click the row again to let go)" : ""}`;
  const strips = row.tables.map((t, g) => {
    const div = document.createElement("div");
    div.className = "strip";
    div.dataset.ids = t.ids.map((b) => (b === null ? "-" : b)).join(",");
    const label = row.tables.length > 1 ? `<span class="glabel">${groupName(pool, g)}</span>` : "";
    const skipped = t.skipped ? `<span class="skipped">${t.skipped} earlier</span>` : "";
    div.innerHTML = label + skipped + t.ids.map((b, idx) => {
      if (b === null) return `<span class="blk gone" title="entry ${t.skipped + idx}: given back by the window"></span>`;
      const state = pool.cells[cellOf(pool, b)];
      return `<span class="blk s-${state}" title="entry ${t.skipped + idx}: block ${b}, ${STATE_NAMES[state]}">${b}</span>`;
    }).join("");
    return div;
  });
  panel.replaceChildren(head, ...strips);
}

function blocksCell(r) {
  if (!r.groups) return String(r.num_blocks);
  // sliding-window layers: a group per window; the blocks a window passed were given back
  const held = r.groups.reduce((a, g) => a + g[0], 0), gone = r.groups.reduce((a, g) => a + g[1], 0);
  return `${held} <small title="KV groups: held / given back by the window">(${r.groups.map((g) => g[0] + (g[1] ? "/-" + g[1] : "")).join(" ")})${gone ? ", " + gone + " given back" : ""}</small>`;
}

function drawRequests(snap) {
  const body = $("requests").querySelector("tbody");
  const rows = snap.running.concat(snap.waiting);
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.seq = r.seq;
    tr.dataset.status = r.status;
    tr.dataset.blocks = heldIds(r).join(",");
    tr.dataset.prompt = r.prompt;
    const promptDone = Math.min(r.computed, r.prompt);
    const hit = (100 * Math.min(r.cached, r.prompt)) / r.prompt;
    const done = (100 * promptDone) / r.prompt;
    tr.innerHTML = `<td><span class="swatch" style="background:${colourOf(r.color)}"></span>${escape(r.seq)}</td>` +
      `<td>${r.status}</td>` +
      `<td><span class="bar"><span class="done" style="width:${done}%"></span><span class="hit" style="width:${hit}%"></span></span> ` +
      `${r.cached} | ${promptDone} / ${r.prompt}</td>` +
      `<td>${r.output}${r.max_tokens ? " / " + r.max_tokens : ""}</td><td>${blocksCell(r)}</td><td>${r.preemptions}</td>`;
    return tr;
  }));
  $("reqinfo").textContent = `${snap.num_running} running, ${snap.num_waiting} waiting`;
}

function drawTimeline(steps) {
  const canvas = $("timeline");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!steps.length) return;
  // scaled to the 90th percentile, so that one long prefill step does not flatten the rest
  const maxTokens = Math.max(1, percentile(steps.map((s) => s[3] + s[4]), 0.9));
  const maxTime = Math.max(1e-6, percentile(steps.map((s) => s[2]), 0.9));
  const w = canvas.width / steps.length, h = canvas.height - 4;
  steps.forEach((s, i) => {
    const dec = Math.min(h, (s[4] / maxTokens) * h), pre = Math.min(h - dec, (s[3] / maxTokens) * h);
    ctx.fillStyle = "#4a7fe5";
    ctx.fillRect(i * w, canvas.height - dec, Math.max(1, w - 1), dec);
    ctx.fillStyle = "#e5734a";
    ctx.fillRect(i * w, canvas.height - dec - pre, Math.max(1, w - 1), pre);
  });
  ctx.strokeStyle = "#222";
  ctx.beginPath();
  steps.forEach((s, i) => ctx.lineTo(i * w + w / 2, canvas.height - Math.min(1, s[2] / maxTime) * h));
  ctx.stroke();
}

function drawStats(snap) {
  const st = snap.stats, steps = snap.steps;
  const span = steps.length > 1 ? steps[steps.length - 1][1] - steps[0][1] : 0;
  const tokens = steps.reduce((a, s) => a + s[4], 0);
  const hits = st.prefix_cache_queries ? (100 * st.prefix_cache_hits) / st.prefix_cache_queries : 0;
  const items = [
    ["KV usage", `${(100 * st.kv_cache_usage).toFixed(1)}%`],
    ["decode tok/s", span > 0 ? (tokens / span).toFixed(1) : "-"],
    ["prefix hit rate", `${hits.toFixed(1)}%`],
    ["preemptions", st.num_preemptions],
    ["tokens recomputed", st.num_recomputed_tokens],
    ["batch (last step)", steps.length ? steps[steps.length - 1][5] : 0],
  ];
  const lat = snap.latency || {};
  if (lat.ttft_ms) items.push(["TTFT p50 / p99", `${lat.ttft_ms.p50.toFixed(0)} / ${lat.ttft_ms.p99.toFixed(0)} ms`]);
  if (lat.itl_ms) items.push(["ITL p50 / p99", `${lat.itl_ms.p50.toFixed(0)} / ${lat.itl_ms.p99.toFixed(0)} ms`]);
  if (st.spec_num_draft_tokens) items.push(["drafts kept", `${((100 * st.spec_num_accepted_tokens) / st.spec_num_draft_tokens).toFixed(0)}%`]);
  if (snap.tier) items.push(["KV tier", `${(100 * snap.tier.usage).toFixed(1)}% of ${snap.tier.num_slots}`]);
  $("stats").replaceChildren(...items.map(([k, v]) => {
    const div = document.createElement("div");
    div.className = "stat";
    div.innerHTML = `${k}<b>${v}</b>`;
    return div;
  }));
}

function percentile(values, q) {
  const sorted = values.slice().sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

function escape(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

const history = [];  // the last 120 snapshots' figures (30 s live), for the sparklines

function spark(id, values, max) {
  const canvas = $(id), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(max || 0, ...values, 1e-9);
  ctx.strokeStyle = "#4a7fe5";
  ctx.beginPath();
  values.forEach((v, i) => ctx.lineTo((i / Math.max(1, 119)) * canvas.width, canvas.height - 2 - (v / top) * (canvas.height - 4)));
  ctx.stroke();
  ctx.fillStyle = "#555";
  ctx.fillText(String(Math.round(values[values.length - 1] * 10) / 10), 2, 10);
}

function drawSparks(snap) {
  const last = snap.steps.length ? snap.steps[snap.steps.length - 1] : null;
  history.push({ kv: 100 * snap.stats.kv_cache_usage, run: snap.num_running, tok: last ? last[3] + last[4] : 0 });
  if (history.length > 120) history.shift();
  spark("spark-kv", history.map((h) => h.kv), 100);
  spark("spark-run", history.map((h) => h.run));
  spark("spark-tok", history.map((h) => h.tok));
}

function drawTier(tier) {
  $("tiersection").hidden = !tier;
  if (!tier) return;
  const canvas = $("tier"), n = tier.cells.length;
  const width = canvas.clientWidth || canvas.width;
  const size = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 80) / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(width / size));
  canvas.width = width;
  canvas.height = Math.ceil(n / cols) * size;
  canvas.dataset.cells = tier.cells;
  const ctx = canvas.getContext("2d");
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = TIER_COLOURS[tier.cells[i]] || TIER_COLOURS["."];
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - 1, size - 1);
  }
  const c = tier.counts, per = tier.slots_per_cell > 1 ? `, ${tier.slots_per_cell} a cell` : "";
  $("tierinfo").textContent = `${tier.num_slots} slots${per}: ${c.ready} ready, ${c.writing} being written, ` +
    `${c.reading} being read back, ${c.empty} empty; ${tier.blocks_stored} stored, ${tier.blocks_loaded} loaded since start`;
}

const TIER_COLOURS = { ".": "#eeeeee", w: "#e5a04a", r: "#6a8fc7", l: "#2ca02c" };

function render(snap) {
  snapshot = snap;
  drawSparks(snap);
  $("model").textContent = snap.model || "";
  drawStats(snap);
  const row = selectedRow(snap);
  drawPool(snap.pool, row, newWindowFrees(snap.pool));
  drawRequests(snap);
  drawTable(snap, row);
  drawTier(snap.tier);
  drawTimeline(snap.steps);
}

function headers() {
  const key = sessionStorage.getItem("octavo-key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function connect() {
  const status = $("status");
  try {
    const resp = await fetch("/dashboard/events", { headers: headers() });
    if (resp.status === 401) {
      status.textContent = "needs the API key";
      status.className = "status error";
      $("keyform").hidden = false;
      return;
    }
    status.textContent = "live";
    status.className = "status live";
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (event.startsWith("data: ")) render(JSON.parse(event.slice(6)));
      }
    }
  } catch (err) {
    console.error(err);
  }
  status.textContent = "reconnecting";
  status.className = "status error";
  setTimeout(connect, 2000);
}

function holdersOf(snap, cellIndex) {
  // the listed requests whose tables hold a block of this cell (from the snapshot: no request)
  const pool = snap.pool;
  return snap.running.concat(snap.waiting).filter((r) => heldIds(r).some((b) => cellOf(pool, b) === cellIndex));
}

function markRows(seqs) {
  document.querySelectorAll("#requests tbody tr").forEach((tr) => tr.classList.toggle("hl", seqs.includes(tr.dataset.seq)));
}

function redrawSelection() {
  if (!snapshot) return;
  const row = selectedRow(snapshot);
  drawPool(snapshot.pool, row, freshFrees);
  drawTable(snapshot, row);
}

let hoverTimer = null;
$("pool").addEventListener("mousemove", (ev) => {
  if (!snapshot) return;
  const rect = ev.target.getBoundingClientRect();
  const i = Math.floor((ev.clientY - rect.top) / cell.size) * cell.cols + Math.floor((ev.clientX - rect.left) / cell.size);
  const pool = snapshot.pool, tip = $("tooltip");
  if (i < 0 || i >= pool.cells.length) { tip.hidden = true; markRows([]); return; }
  const first = i * pool.blocks_per_cell;
  const label = pool.blocks_per_cell > 1 ? `blocks ${first}..${first + pool.blocks_per_cell - 1}` : `block ${i}`;
  const refs = pool.num_shared_owners[String(i)];
  const holders = holdersOf(snapshot, i).map((r) => r.seq);
  const group = pool.groups && pool.groups[i] >= 0 ? `, ${groupName(pool, pool.groups[i])}` : "";
  tip.textContent = `${label}: ${STATE_NAMES[pool.cells[i]]}${refs ? `, ref count ${refs}` : ""}${group}` +
    (holders.length ? `\nheld by ${holders.join(", ")}` : "");
  markRows(holders);
  tip.style.left = `${ev.clientX + 12}px`;
  tip.style.top = `${ev.clientY + 12}px`;
  tip.hidden = false;
  clearTimeout(hoverTimer);
  if (!window.OCTAVO_REPLAY && pool.blocks_per_cell === 1 && "us".includes(pool.cells[i])) {
    hoverTimer = setTimeout(async () => {
      const resp = await fetch(`/dashboard/blocks/${i}`, { headers: headers() });
      if (!resp.ok) return;
      const info = await resp.json();
      if (!holders.length && info.holders.length) tip.textContent += `\nheld by ${info.holders.join(", ")}`;
      tip.textContent += info.text !== null ? `\n${info.text}` : "\n(text: only with an API key)";
    }, 150);
  }
});
const tbody = $("requests").querySelector("tbody");
tbody.addEventListener("mouseover", (ev) => {
  const tr = ev.target.closest("tr");
  if (tr && tr.dataset.seq !== selected.hover) { selected.hover = tr.dataset.seq; redrawSelection(); }
});
tbody.addEventListener("mouseleave", () => { selected.hover = null; redrawSelection(); });
tbody.addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr");
  if (!tr) return;
  selected.pinned = selected.pinned === tr.dataset.seq ? null : tr.dataset.seq;
  redrawSelection();
});
$("pool").addEventListener("mouseleave", () => { $("tooltip").hidden = true; markRows([]); });
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("octavo-key", $("key").value);
  $("keyform").hidden = true;
  connect();
});

// Replay (octavo simulate --dashboard FILE.html): the frames are in the page; play them 4 a second.
function startReplay(replay) {
  const names = Object.keys(replay.runs);
  const policy = $("policy"), slider = $("frame"), play = $("play");
  let frames = [], index = 0, playing = true;
  policy.replaceChildren(...names.map((n) => { const o = document.createElement("option"); o.textContent = n; return o; }));
  const show = () => {
    const snap = frames[index];
    render(snap);
    slider.value = index;
    $("frameinfo").textContent = `frame ${index + 1} / ${frames.length}, t = ${snap.time.toFixed(2)} s (simulated)`;
  };
  const choose = () => { frames = replay.runs[policy.value]; slider.max = frames.length - 1; index = 0; history.length = 0; lastWindowFreed = null; show(); };
  policy.addEventListener("change", choose);
  slider.addEventListener("input", () => { index = Number(slider.value); show(); });
  play.addEventListener("click", () => { playing = !playing; play.textContent = playing ? "pause" : "play"; });
  setInterval(() => { if (playing && frames.length) { index = (index + 1) % frames.length; show(); } }, 250);
  $("replay").hidden = false;
  $("status").textContent = `replay: ${replay.title}`;
  $("status").className = "status live";
  choose();
}

if (window.OCTAVO_REPLAY) startReplay(window.OCTAVO_REPLAY);
else connect();
