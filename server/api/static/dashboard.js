// The dashboard's script: asks for the API key once (kept in this tab's sessionStorage, sent as the
// X-API-Key header, never in a URL), then polls the overview and the selected run's curves.
// Every value from the server goes into the page as text (textContent), never as markup.
"use strict";

const KEY_STORAGE = "tinker-dashboard-api-key";
const REFRESH_MS = 3000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let selectedRun = null;
let timer = null;
let lastSampling = null;  // the previous poll's tally and time, for the request rate

function apiKey() { return sessionStorage.getItem(KEY_STORAGE); }

async function api(path) {
  const response = await fetch(path, { headers: { "X-API-Key": apiKey() }, cache: "no-store" });
  if (response.status === 401) throw new Error("the server refused this API key");
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "" : String(text);
  td.title = td.textContent;  // the whole value, where the cell cuts it
  if (className) td.className = className;
  return td;
}

function number(value) {
  // Short enough for an axis: 3 significant digits, exponents where plain digits would run long.
  const size = Math.abs(value);
  if (value !== 0 && (size < 1e-3 || size >= 1e5)) return value.toExponential(2);
  return String(Number(value.toPrecision(3)));
}

function showSampling(sampling) {
  const now = Date.now();
  let rate = "";
  if (lastSampling !== null && now > lastSampling.at) {
    const perSecond = (sampling.requests - lastSampling.requests) * 1000 / (now - lastSampling.at);
    rate = `, ${perSecond.toFixed(1)}/s`;
  }
  lastSampling = { requests: sampling.requests, at: now };
  $("sampling").textContent = `${sampling.requests} requests${rate}, ${sampling.in_flight} in flight, ` +
                              `${sampling.sampled_tokens} tokens`;
  const prompt = sampling.prompt_cached_tokens + sampling.prompt_computed_tokens;
  $("cache-hits").textContent = prompt ? `${(100 * sampling.prompt_cached_tokens / prompt).toFixed(0)} %` : "-";
}

function showGpus(gpus) {
  $("gpu-fact").hidden = !gpus.length;
  $("gpu-memory").textContent = gpus.map((g) => `${g.device}: ${bytes(g.reserved_bytes)} of ${bytes(g.total_bytes)}`)
    .join(", ");
}

function fill(tableId, items, columns, onRow) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren();
  if (!items.length) {
    const row = body.insertRow();
    const td = cell(row, "none yet", "empty");
    td.colSpan = $(tableId).tHead.rows[0].cells.length;
    return;
  }
  for (const item of items) {
    const row = body.insertRow();
    for (const [value, className] of columns(item)) cell(row, value, className);
    if (onRow) onRow(row, item);
  }
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (n >= 1024 && unit < units.length - 1) { n /= 1024; unit += 1; }
  return `${n.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds <= 0) return "expired";
  const parts = [[86400, "d"], [3600, "h"], [60, "min"]];
  for (const [size, name] of parts) if (seconds >= size) return `in ${Math.floor(seconds / size)} ${name}`;
  return `in ${Math.floor(seconds)} s`;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : ""; }

function shortId(id) { return id.length > 24 ? `${id.slice(0, 10)}...${id.slice(-12)}` : id; }

function showOverview(data) {
  $("tenant").textContent = data.tenant;
  $("base-model").textContent = data.base_model;
  $("sampler").textContent = data.sampler;
  $("queue-depth").textContent = data.queue_depth;
  $("stored").textContent = bytes(data.stored_bytes);
  showSampling(data.sampling);
  showGpus(data.gpus);
  $("facts").hidden = false;
  if (selectedRun === null && data.runs.length) {
    // The newest run with a curve to show (two steps or more), else the newest.
    selectedRun = (data.runs.find((r) => r.num_steps >= 2) || data.runs[0]).model_id;
  }
  fill("runs", data.runs, (r) => [[r.model_id], [shortId(r.session_id)], [r.lora_rank, "num"], [r.num_steps, "num"],
                                  [r.queue_depth, "num"], [r.loaded ? "yes" : "no"], [when(r.last_request_time)]],
       (row, r) => {
         row.className = r.model_id === selectedRun ? "run selected" : "run";
         row.dataset.modelId = r.model_id;
         row.addEventListener("click", () => { selectedRun = r.model_id; refresh(); });
       });
  fill("checkpoints", data.checkpoints, (c) => [[c.tinker_path], [c.checkpoint_type], [bytes(c.size_bytes), "num"],
                                                [when(c.created_at)], [duration(c.expires_in_seconds)],
                                                [c.public ? "yes" : "no"]]);
  fill("sessions", data.sessions, (s) => [[s.session_id], [s.project_id], [s.display_name || ""], [s.status],
                                          [s.num_runs, "num"], [when(s.last_heartbeat_at)]]);
}

function order(curve) {
  // The loss first, then the sampler/trainer KL, then the loss's other metrics, then the optimizer's.
  if (curve.name === "loss:sum") return 0;
  if (curve.name.startsWith("kl_sample_train")) return 1;
  return curve.kind === "forward_backward" ? 2 : 3;
}

function chart(curve) {
  const width = 380, height = 170, left = 56, right = 10, top = 10, bottom = 24;
  const steps = curve.points.map((p) => p[0]);
  const values = curve.points.map((p) => p[1]);
  let [low, high] = [Math.min(...values), Math.max(...values)];
  if (low === high) { low -= Math.abs(low) * 0.1 || 1; high += Math.abs(high) * 0.1 || 1; }
  const [first, last] = [Math.min(...steps), Math.max(...steps)];
  const x = (step) => left + (last === first ? 0.5 : (step - first) / (last - first)) * (width - left - right);
  const y = (value) => top + (1 - (value - low) / (high - low)) * (height - top - bottom);

  const figure = document.createElement("figure");
  figure.className = "chart";
  figure.dataset.metric = curve.name;
  figure.dataset.kind = curve.kind;
  figure.dataset.points = String(curve.points.length);
  const caption = document.createElement("figcaption");
  caption.textContent = `${curve.name} `;
  const latest = document.createElement("small");
  latest.textContent = `(${curve.kind}; last ${values[values.length - 1].toPrecision(5)} at step ${last})`;
  caption.append(latest);
  figure.append(caption);

  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  const add = (name, attributes, text) => {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
    if (text !== undefined) element.textContent = text;
    svg.append(element);
    return element;
  };
  add("line", { class: "axis", x1: left, y1: height - bottom, x2: width - right, y2: height - bottom });
  add("line", { class: "axis", x1: left, y1: top, x2: left, y2: height - bottom });
  add("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, number(high));
  add("text", { x: left - 4, y: height - bottom, "text-anchor": "end" }, number(low));
  add("text", { x: left, y: height - 8 }, `step ${first}`);
  add("text", { x: width - right, y: height - 8, "text-anchor": "end" }, `step ${last}`);
  add("polyline", { class: "line", points: curve.points.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" ") });
  if (curve.points.length <= 200) {
    for (const [s, v] of curve.points) {
      add("circle", { class: "dot", cx: x(s).toFixed(1), cy: y(v).toFixed(1), r: 2 })
        .append(Object.assign(document.createElementNS(SVG, "title"), { textContent: `step ${s}: ${v}` }));
    }
  }
  figure.append(svg);
  return figure;
}

function showCurves(data) {
  $("curves-title").textContent = `Curves of ${data.model_id} (${data.num_steps} steps)`;
  const curves = data.curves.filter((c) => c.points.length).sort((a, b) => order(a) - order(b) ||
                                                                  a.name.localeCompare(b.name));
  $("curves-note").textContent = curves.length ? "" : "No training step recorded yet.";
  $("curves-note").hidden = curves.length > 0;
  $("charts").replaceChildren(...curves.map(chart));
}

async function refresh() {
  clearTimeout(timer);
  if (!apiKey()) return;
  try {
    showOverview(await api("/api/v1/dashboard/overview"));
    if (selectedRun !== null) {
      showCurves(await api(`/api/v1/dashboard/runs/${encodeURIComponent(selectedRun)}/curves`));
    }
    $("status").textContent = "";
    $("content").hidden = false;
    $("forget").hidden = false;
  } catch (error) {
    $("status").textContent = error.message;
    if (error.message.includes("refused")) { sessionStorage.removeItem(KEY_STORAGE); return; }
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("api-key").value = "";
  selectedRun = null;
  refresh();
});

$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  clearTimeout(timer);
  $("content").hidden = true;
  $("facts").hidden = true;
  $("forget").hidden = true;
});

refresh();
