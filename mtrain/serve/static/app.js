// The page of `mtrain serve`: translate, then step through one sentence's decoding and look at
// its attention weights; or watch the run learn (the training view: its curves, and its example
// sentences at each validation). The URL's hash holds the view
// (#text=…&explain=1&step=…&kind=…, #view=training), so a link opens the same thing again.
"use strict";

// A server started with a token (mtrain serve --token-file) answers the API 401 until a request
// carries it: ask for it once, keep it for this tab, and send it with every request after.
const TOKEN_KEY = "mtrain-serve-token";
const plainFetch = window.fetch.bind(window);
window.fetch = async (resource, init = {}) => {
  const send = async () => {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = new Headers(init.headers || {});
    if (token) headers.set("Authorization", `Bearer ${token}`);
    return [token, await plainFetch(resource, { ...init, headers })];
  };
  const [sent, response] = await send();
  if (response.status !== 401) return response;
  if (sessionStorage.getItem(TOKEN_KEY) === sent) { // not asked since this request went
    const token = window.prompt("This server needs its token (the text of its --token-file):");
    if (!token || !token.trim()) return response;
    sessionStorage.setItem(TOKEN_KEY, token.trim());
  }
  return (await send())[1];
};

const KINDS = {
  encoder: {
    name: "Encoder self-attention",
    rows: "source pieces (queries)",
    cols: "source pieces (keys)",
  },
  decoder: {
    name: "Decoder masked self-attention",
    rows: "decoder input (queries)",
    cols: "decoder input (keys); grey: masked, a later position",
  },
  cross: {
    name: "Cross-attention",
    rows: "the output piece each query chose (queries from the decoder)",
    cols: "source pieces (keys and values from the encoder)",
  },
};

const $ = (id) => document.getElementById(id);
const ALL_HEADS = -2; // the head control's value that shows every head and their mean
const MEAN = -1;
const view = { kind: "cross", layer: 0, head: ALL_HEADS, step: 1 };
let explained = null; // the /explain answer shown

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

function svgEl(tag, attrs = {}, text = null) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function pieceChips(pieces, weights = null) {
  return pieces.map((p, i) => {
    const chip = el("span", { class: "piece", lang: "zh" }, p);
    if (weights) {
      chip.style.background = color(weights[i]);
      chip.style.color = weights[i] > 0.55 ? "#fff" : "";
      chip.title = `${p}: ${weights[i].toFixed(3)}`;
    }
    return chip;
  });
}

// White to deep blue: the weight of one cell (masked cells are drawn grey by the caller).
function color(w) {
  const t = Math.sqrt(Math.max(0, Math.min(1, w))); // small weights stay visible
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(247, 8)}, ${mix(251, 48)}, ${mix(255, 107)})`;
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  if (!response.ok) throw new Error(answer.error || response.statusText);
  return answer;
}

function options() {
  const alpha = parseFloat($("alpha").value);
  return { beam: parseInt($("beam").value, 10), ...(isNaN(alpha) ? {} : { alpha }) };
}

function say(text, bad = false) {
  $("status").textContent = text;
  $("status").className = bad ? "bad" : "";
}

async function translate() {
  const lines = $("source").value.split("\n").map((s) => s.trim()).filter((s) => s);
  if (!lines.length) return say("type a sentence first", true);
  say("translating…");
  try {
    const answer = await post("/translate", { text: lines, ...options() });
    $("results").replaceChildren(
      ...answer.translations.map((t, i) => {
        const button = el("button", { type: "button", class: "explain" }, "step through");
        button.addEventListener("click", () => explain(lines[i]));
        const warn = t.truncated ? el("span", { class: "bad" }, " (input cut short)") : "";
        return el("li", {}, el("span", { class: "src", lang: "zh" }, lines[i]), " → ",
          el("span", { class: "out" }, t.text), warn, " ", button);
      })
    );
    say("");
    served(answer.checkpoint_step);
    setHash({ text: lines.join("\n") });
  } catch (e) {
    say(e.message, true);
  }
}

async function explain(text) {
  say("decoding step by step…");
  try {
    explained = await post("/explain", { text, ...options() });
  } catch (e) {
    return say(e.message, true);
  }
  say("");
  $("explain-panel").hidden = false;
  $("explained").textContent = text;
  const att = explained.attention;
  $("source-pieces").replaceChildren(el("span", { class: "label" }, "source pieces: "),
    ...pieceChips(explained.source.pieces));
  const steps = explained.steps.length;
  $("step").max = Math.max(steps, 1);
  $("layer").replaceChildren(...(att ? att.encoder : []).map((_, i) =>
    el("option", { value: i }, `${i + 1}`)));
  const heads = att ? att.encoder[0].length : 0;
  $("head").replaceChildren(el("option", { value: ALL_HEADS }, "all"),
    el("option", { value: MEAN }, "mean"),
    ...Array.from({ length: heads }, (_, i) => el("option", { value: i }, `${i + 1}`)));
  view.step = Math.min(view.step, Math.max(steps, 1));
  view.layer = Math.min(view.layer, Math.max(att ? att.encoder.length - 1 : 0, 0));
  view.head = Math.max(Math.min(view.head, heads - 1), ALL_HEADS);
  setHash({ explain: text });
  show();
}

// One head's (query, key) weights in the layer shown; the mean of the heads for MEAN.
function weightsOf(kind, head) {
  const layers = explained.attention[kind][view.layer]; // [head][query][key]
  if (head >= 0) return layers[head];
  return layers[0].map((row, q) => row.map((_, k) =>
    layers.reduce((sum, head) => sum + head[q][k], 0) / layers.length));
}

function show() {
  $("step").value = view.step;
  $("layer").value = view.layer;
  $("head").value = view.head;
  document.querySelectorAll("#picture .block").forEach((b) =>
    b.classList.toggle("selected", b.dataset.kind === view.kind));
  document.querySelectorAll("#kinds button").forEach((b) =>
    b.setAttribute("aria-selected", b.dataset.kind === view.kind));
  showStep();
  showMap();
  setHash({ step: view.step, kind: view.kind, layer: view.layer + 1, head: view.head + 1 });
}

function showStep() {
  const steps = explained.steps;
  const box = $("step-view");
  if (!steps.length) {
    $("step-label").textContent = "";
    return box.replaceChildren(el("p", {}, "An empty sentence: nothing to decode."));
  }
  const step = steps[view.step - 1];
  $("step-label").textContent = `step ${step.step} of ${steps.length}`;
  if (step.top) return box.replaceChildren(...greedyStep(step));
  box.replaceChildren(...beamStep(step));
}

function greedyStep(step) {
  const input = el("p", {}, el("span", { class: "label" }, "decoder input so far: "),
    ...pieceChips(step.input));
  const rows = step.top.map((c) => el("tr", { class: c.id === step.chosen.id ? "chosen" : "" },
    el("td", { class: "piece-cell", lang: "zh" }, c.piece),
    el("td", { class: "bar-cell" }, el("span", { class: "bar", style: `width:${100 * c.prob}%` })),
    el("td", { class: "num" }, c.prob.toFixed(4)),
    el("td", {}, c.id === step.chosen.id ? "← chosen" : "")));
  const table = el("table", { class: "candidates" },
    el("caption", {}, "the likeliest next pieces and their probabilities"), el("tbody", {}, ...rows));
  const att = explained.attention;
  const parts = [input, table];
  if (att && view.step - 1 < att.output.length) {
    const head = view.head >= 0 ? view.head : MEAN;
    parts.push(el("p", {}, el("span", { class: "label" },
      `where the decoder looked (cross-attention, layer ${view.layer + 1}, ${headName(head)}): `),
    ...pieceChips(att.source, weightsOf("cross", head)[view.step - 1])));
  }
  return parts;
}

function beamStep(step) {
  const hyps = step.hypotheses.map((h, j) => el("tr", {}, el("td", {}, `[${j}]`),
    el("td", { class: "num" }, h.log_prob.toFixed(4)), el("td", {}, ...pieceChips(h.input))));
  const cands = step.candidates.map((c) => el("tr", { class: c.fate.split(" ")[0] },
    el("td", {}, `[${c.origin}]`), el("td", { class: "piece-cell", lang: "zh" }, `+ ${c.piece}`),
    el("td", { class: "num" }, c.token_log_prob.toFixed(4)),
    el("td", { class: "num" }, c.log_prob.toFixed(4)),
    el("td", {}, c.fate + (c.score === null ? "" : `: score ${c.score.toFixed(4)}`))));
  return [
    el("table", { class: "candidates" }, el("caption", {},
      "live hypotheses and their cumulative log-probabilities"), el("tbody", {}, ...hyps)),
    el("table", { class: "candidates" }, el("caption", {},
      "their best extensions, best first: piece, its log-probability, the sum, its fate"),
    el("tbody", {}, ...cands)),
  ];
}

function headName(head) {
  return head >= 0 ? `head ${head + 1}` : "mean of heads";
}

function showMap() {
  const att = explained.attention;
  if (!att) return $("heatmap").replaceChildren();
  const kind = KINDS[view.kind];
  const labels = {
    encoder: [att.source, att.source],
    decoder: [att.decoder_input, att.decoder_input],
    cross: [att.output, att.source],
  }[view.kind];
  const which = view.head === ALL_HEADS ? "every head and their mean" : headName(view.head);
  $("map-caption").textContent =
    `${kind.name}, layer ${view.layer + 1}, ${which}. Rows: ${kind.rows}. Columns: ${kind.cols}.`;
  const highlight = view.kind === "encoder" || !explained.steps[0].top ? -1 : view.step - 1;
  const heads = view.head === ALL_HEADS
    ? [...att[view.kind][view.layer].keys(), MEAN] : [view.head];
  $("heatmap").replaceChildren(...heads.map((head) => el("figure", { class: "map" },
    heatmap(weightsOf(view.kind, head), ...labels, highlight, view.kind === "decoder"),
    el("figcaption", {}, headName(head)))));
}

// An SVG heatmap of (query, key) weights; with `lookAhead`, keys after the query are masked.
function heatmap(weights, rows, cols, highlight, lookAhead) {
  const cell = 30, left = 10 + 14 * Math.max(...rows.map((p) => p.length), 2);
  const top = 10 + 14 * Math.max(...cols.map((p) => p.length), 2);
  const svg = svgEl("svg", {
    class: "heatmap", width: left + cell * cols.length + 10, height: top + cell * rows.length + 10,
  });
  cols.forEach((p, k) => svg.append(svgEl("text", {
    class: "col-label", transform: `translate(${left + k * cell + cell / 2 + 5},${top - 6}) rotate(-90)`,
  }, p)));
  rows.forEach((p, q) => {
    svg.append(svgEl("text", {
      class: "row-label" + (q === highlight ? " current" : ""), x: left - 6, y: top + q * cell + cell / 2 + 5,
    }, p));
    weights[q].forEach((w, k) => {
      const rect = svgEl("rect", {
        class: "cell", x: left + k * cell, y: top + q * cell, width: cell - 1, height: cell - 1,
        fill: lookAhead && k > q ? "#d0d0d0" : color(w),
      });
      rect.append(svgEl("title", {}, `${p} → ${cols[k]}: ${w.toFixed(4)}`));
      svg.append(rect);
    });
  });
  if (highlight >= 0 && highlight < rows.length) {
    svg.append(svgEl("rect", {
      class: "current-row", x: left - 2, y: top + highlight * cell - 2,
      width: cell * cols.length + 3, height: cell + 3,
    }));
  }
  return svg;
}

function setHash(parts) {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const [key, value] of Object.entries(parts)) params.set(key, value);
  history.replaceState(null, "", "#" + params.toString());
}

function setKind(kind) {
  view.kind = kind;
  if (explained) show();
}

let described = null; // the /model answer

function describe(model) {
  described = model;
  const step = model.checkpoint_step === null ? "" : ` of update ${model.checkpoint_step}`;
  $("model").textContent = `${model.src_lang} → ${model.tgt_lang}, ` +
    `${model.parameters.toLocaleString("en")} parameters, ${model.model.n_encoder_layers} + ` +
    `${model.model.n_decoder_layers} layers of ${model.model.n_heads} heads; ` +
    `${model.run} (${model.checkpoint}${step}, ${model.engine})`;
}

// A translation names the checkpoint it came from: a run still training may have saved a newer.
function served(step) {
  if (described && step !== undefined && step !== described.checkpoint_step) {
    describe({ ...described, checkpoint_step: step });
  }
}

function setup(model) {
  describe(model);
  // The run's own beam size is always a choice (the default recipe's is 6).
  const beams = [...new Set([1, 2, 4, 5, 8, model.decode.beam])].sort((a, b) => a - b);
  $("beam").replaceChildren(...beams.map((b) =>
    el("option", { value: b }, b === 1 ? "1 (greedy)" : `${b}`)));
  $("beam").value = model.decode.beam;
  $("alpha").value = model.decode.alpha;
  $("kinds").replaceChildren(...Object.entries(KINDS).map(([kind, k]) => {
    const b = el("button", { type: "button", role: "tab", "data-kind": kind }, k.name);
    b.addEventListener("click", () => setKind(kind));
    return b;
  }));
  document.querySelectorAll("#picture .block").forEach((b) =>
    b.addEventListener("click", () => setKind(b.dataset.kind)));
  $("translate").addEventListener("click", translate);
  $("source").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate();
  });
  const move = (by) => {
    view.step = Math.max(1, Math.min(explained.steps.length, view.step + by));
    show();
  };
  $("prev").addEventListener("click", () => move(-1));
  $("next").addEventListener("click", () => move(1));
  $("step").addEventListener("input", () => { view.step = parseInt($("step").value, 10); show(); });
  $("layer").addEventListener("change", () => { view.layer = parseInt($("layer").value, 10); show(); });
  $("head").addEventListener("change", () => { view.head = parseInt($("head").value, 10); show(); });
  if (!model.explain) $("status").textContent = "this engine shows translations only, no steps";
  setupTraining();
}

// Open the view the hash names, through the same controls a reader uses.
async function restore() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.get("view") === "training") setView("training");
  if (params.has("beam")) $("beam").value = params.get("beam");
  if (!params.has("text")) return;
  $("source").value = params.get("text");
  await translate();
  if (!params.has("explain")) return;
  view.step = parseInt(params.get("step") || "1", 10);
  view.kind = KINDS[params.get("kind")] ? params.get("kind") : "cross";
  view.layer = parseInt(params.get("layer") || "1", 10) - 1;
  view.head = params.has("head") ? parseInt(params.get("head"), 10) - 1 : ALL_HEADS;
  const item = [...document.querySelectorAll("#results li")]
    .find((li) => li.querySelector(".src").textContent === params.get("explain"));
  if (item) await explain(params.get("explain"));
}

// The training view -----------------------------------------------------------------------------
// /training answers the run's curves and, per validation, the example translations; each
// example's attention at one validation comes from /training/attention when it is looked at.

const POLL_MS = 3000;
const training = {
  data: null, // the /training answer shown
  etag: null,
  x: "step", // or "minutes"
  example: 0, // index into data.examples.sources
  validation: 0, // index into data.examples.validations
  follow: true, // the slider stays on the newest validation as new ones come
  layer: 0,
  head: MEAN,
  maps: new Map(), // "step event source" -> the /training/attention answer
};

function setView(name) {
  document.body.dataset.view = name;
  document.querySelectorAll("#views button").forEach((b) =>
    b.setAttribute("aria-selected", b.dataset.view === name));
  setHash({ view: name });
  if (name === "training") pollTraining();
}

function setupTraining() {
  document.querySelectorAll("#views button").forEach((b) =>
    b.addEventListener("click", () => setView(b.dataset.view)));
  document.querySelectorAll("#x-axis button").forEach((b) => b.addEventListener("click", () => {
    training.x = b.dataset.x;
    document.querySelectorAll("#x-axis button").forEach((o) =>
      o.setAttribute("aria-selected", o === b));
    showCurves();
  }));
  $("validation").addEventListener("input", () => {
    training.validation = parseInt($("validation").value, 10);
    training.follow = training.validation === parseInt($("validation").max, 10);
    showExamples();
  });
  $("example").addEventListener("change", () => {
    training.example = parseInt($("example").value, 10);
    showExamples();
  });
  $("ex-layer").addEventListener("change", () => {
    training.layer = parseInt($("ex-layer").value, 10);
    showAttention();
  });
  $("ex-head").addEventListener("change", () => {
    training.head = parseInt($("ex-head").value, 10);
    showAttention();
  });
  setInterval(() => { if (document.body.dataset.view === "training") pollTraining(); }, POLL_MS);
}

let polling = false;

async function pollTraining() {
  if (polling) return;
  polling = true;
  try {
    // The browser revalidates with the ETag: an unchanged run costs a 304 and no drawing.
    const response = await fetch("/training", { cache: "no-cache" });
    if (!response.ok) throw new Error((await response.json()).error || response.statusText);
    const etag = response.headers.get("ETag");
    if (etag !== training.etag || !training.data) {
      training.data = await response.json();
      training.etag = etag;
      showTraining();
    }
    const model = await (await fetch("/model")).json();
    served(model.checkpoint_step);
    $("training-status").className = "label";
  } catch (e) {
    $("training-status").textContent = `cannot read the run: ${e.message}`;
    $("training-status").className = "bad";
  } finally {
    polling = false;
  }
}

function showTraining() {
  const d = training.data;
  const steps = d.train.step, checks = d.validations;
  const last = Math.max(steps.length ? steps[steps.length - 1] : 0,
    checks.length ? checks[checks.length - 1].step : 0);
  const minutes = Math.max(d.train.minutes.length ? d.train.minutes[d.train.minutes.length - 1] : 0,
    checks.length ? checks[checks.length - 1].minutes : 0);
  const saved = described && described.checkpoint_step !== null
    ? `; the translator serves update ${described.checkpoint_step}` : "";
  $("training-status").textContent = steps.length || checks.length
    ? `${last} updates, ${minutes.toFixed(1)} minutes, ${checks.length} validations${saved}`
    : "no training logged yet in this run directory";
  for (const error of d.errors) $("training-status").textContent += ` (${error})`;
  showCurves();
  showExamples();
}

function showCurves() {
  const d = training.data;
  if (!d) return;
  const x = training.x, xName = x === "step" ? "updates" : "minutes";
  const along = (ys) => d.train[x].map((v, i) => [v, ys[i]]).filter((p) => p[1] !== null);
  const checks = (event) => d.validations.filter((v) => v.event === event && v.dev_bleu !== null)
    .map((v) => [v[x], v.dev_bleu]);
  const xMax = Math.max(0, ...d.train[x], ...d.validations.map((v) => v[x])); // one axis for all
  $("curves").replaceChildren(
    chart("training loss", [{ points: along(d.train.loss), name: "loss" }], xName, xMax, false),
    chart("dev BLEU", [{ points: checks("validation"), name: "BLEU", dots: true },
      { points: checks("average"), name: "BLEU of the averaged model", dots: true, only: true }],
    xName, xMax, true),
    chart("learning rate", [{ points: along(d.train.lr), name: "lr" }], xName, xMax, true),
  );
}

// Round steps for an axis from lo to hi: about n of them, each 1, 2 or 5 times a power of ten.
function ticks(lo, hi, n = 4) {
  const rough = (hi - lo) / n;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough);
  const first = Math.floor(lo / step) * step, last = Math.ceil(hi / step) * step;
  const values = [];
  for (let i = 0; first + i * step <= last + step / 1e6; i++) values.push(first + i * step);
  return { lo: first, hi: last, values };
}

function number(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 0.01 || a >= 1e5) return v.toExponential(1).replace(".0e", "e");
  return `${+v.toFixed(3)}`;
}

// A line chart in SVG; series with `dots` mark each point, `only` draws no line.
function chart(title, series, xName, xMax, fromZero) {
  const W = 300, H = 200, L = 50, R = 14, T = 28, B = 40;
  const points = series.flatMap((s) => s.points);
  const svg = svgEl("svg", {
    class: "chart", viewBox: `0 0 ${W} ${H}`,
    "data-title": title, "data-points": series[0].points.length,
  });
  svg.append(svgEl("text", { class: "chart-title", x: L, y: 16 }, title));
  if (!points.length) {
    svg.append(svgEl("text", { class: "empty", x: (L + W - R) / 2, y: H / 2 }, "nothing yet"));
    return svg;
  }
  const ys = points.map((p) => p[1]);
  let yLo = fromZero ? Math.min(0, ...ys) : Math.min(...ys), yHi = Math.max(...ys);
  if (yHi <= yLo) yHi = yLo + (Math.abs(yLo) || 1);
  const xt = ticks(0, xMax > 0 ? xMax : 1), yt = ticks(yLo, yHi);
  const X = (v) => L + (v - xt.lo) / (xt.hi - xt.lo) * (W - L - R);
  const Y = (v) => H - B - (v - yt.lo) / (yt.hi - yt.lo) * (H - T - B);
  for (const v of yt.values) {
    svg.append(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: Y(v), y2: Y(v) }));
    svg.append(svgEl("text", { class: "tick y", x: L - 6, y: Y(v) + 4 }, number(v)));
  }
  for (const v of xt.values) {
    svg.append(svgEl("line", { class: "grid", x1: X(v), x2: X(v), y1: T, y2: H - B }));
    svg.append(svgEl("text", { class: "tick x", x: X(v), y: H - B + 16 }, number(v)));
  }
  svg.append(svgEl("text", { class: "axis-name", x: (L + W - R) / 2, y: H - 6 }, xName));
  series.forEach((s, i) => {
    const cls = `series s${i}`;
    if (!s.only && s.points.length) {
      svg.append(svgEl("polyline", {
        class: cls, points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "),
      }));
    }
    if (s.dots) {
      for (const [px, py] of s.points) {
        const dot = svgEl("circle", { class: cls, cx: X(px), cy: Y(py), r: s.only ? 5 : 3 });
        dot.append(svgEl("title", {}, `${s.name} ${number(py)} at ${number(px)} ${xName}`));
        svg.append(dot);
      }
    }
  });
  return svg;
}

function showExamples() {
  const ex = training.data.examples, rows = ex.validations;
  const table = $("examples-table");
  if (!ex.sources.length) {
    table.replaceChildren(el("caption", {}, "No validation has written its examples yet."));
    $("example").replaceChildren();
    $("ex-heatmap").replaceChildren();
    $("ex-heatmap").removeAttribute("data-step");
    $("validation-label").textContent = "";
    return;
  }
  training.example = Math.min(training.example, ex.sources.length - 1);
  const max = rows.length - 1;
  if (training.follow || training.validation > max) training.validation = max;
  const head = el("tr", {}, el("th", {}, "update"), el("th", {}, "minutes"),
    ...ex.sources.map((source, i) => el("th", { class: i === training.example ? "chosen" : "" },
      el("span", { lang: "zh" }, source),
      ex.references[i] === null ? "" : el("span", { class: "reference" }, ex.references[i]))));
  const body = rows.map((row, r) => el("tr", { class: r === training.validation ? "current" : "" },
    el("td", { class: "num" }, `${row.step}`),
    el("td", { class: "num" }, row.minutes.toFixed(1)),
    ...row.translations.map((t, i) => {
      const cell = el("td", { class: i === training.example ? "chosen" : "" },
        t === null ? "" : t, row.event === "average" ? el("span", { class: "label" }, " (averaged)") : "");
      cell.addEventListener("click", () => {
        training.example = i;
        training.validation = r;
        training.follow = r === max;
        showExamples();
      });
      return cell;
    })));
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...body));
  // The table scrolls inside its box: keep the row the slider shows in sight, under the header.
  const wrap = table.parentElement, current = body[training.validation];
  const top = current.offsetTop - table.tHead.offsetHeight;
  if (top < wrap.scrollTop || current.offsetTop + current.offsetHeight > wrap.scrollTop + wrap.clientHeight) {
    wrap.scrollTop = Math.max(0, top);
  }
  choices($("example"), ex.sources.map((s, i) => [i, s]));
  $("example").value = training.example;
  $("validation").max = max;
  $("validation").value = training.validation;
  const row = rows[training.validation];
  $("validation-label").textContent = `${training.validation + 1} of ${rows.length}: ` +
    `update ${row.step}${row.event === "average" ? " (averaged model)" : ""}`;
  showAttention();
}

// Set a list's options to [value, label] pairs; the same ones are left alone, so that a list a
// reader holds open is not closed by the next poll.
function choices(select, pairs) {
  const now = [...select.options].map((o) => `${o.value}\t${o.textContent}`).join("\n");
  if (now === pairs.map(([v, label]) => `${v}\t${label}`).join("\n")) return;
  select.replaceChildren(...pairs.map(([v, label]) => el("option", { value: v }, label)));
}

async function showAttention() {
  const ex = training.data.examples, row = ex.validations[training.validation];
  const source = ex.sources[training.example];
  const key = `${row.step} ${row.event} ${source}`;
  let att = training.maps.get(key);
  if (!att) {
    const query = new URLSearchParams({ validation: training.validation, source });
    const response = await fetch(`/training/attention?${query}`);
    if (!response.ok) return;
    att = await response.json();
    training.maps.set(key, att);
    const now = training.data.examples.validations[training.validation];
    if (!now || `${now.step} ${now.event} ${training.data.examples.sources[training.example]}` !== key) {
      return; // the reader moved on while this came
    }
  }
  drawAttention(att);
}

function drawAttention(att) {
  const layers = att.attention; // [layer][head][tgt][src]
  const box = $("ex-heatmap");
  box.dataset.step = att.step;
  if (!layers.length) {
    $("ex-caption").textContent = "";
    return box.replaceChildren(el("p", {}, "No attention was recorded for this example."));
  }
  training.layer = Math.min(training.layer, layers.length - 1);
  training.head = Math.min(training.head, layers[0].length - 1);
  choices($("ex-layer"), layers.map((_, i) => [i, `${i + 1}`]));
  choices($("ex-head"), [[MEAN, "mean"], ...layers[0].map((_, i) => [i, `${i + 1}`])]);
  $("ex-layer").value = training.layer;
  $("ex-head").value = training.head;
  const heads = layers[training.layer];
  const weights = training.head >= 0 ? heads[training.head]
    : heads[0].map((r, q) => r.map((_, k) => heads.reduce((sum, h) => sum + h[q][k], 0) / heads.length));
  $("ex-caption").textContent = `Cross-attention at update ${att.step}, layer ${training.layer + 1}, ` +
    `${headName(training.head)}: “${att.translation}”. Rows: the pieces the decoder wrote. ` +
    "Columns: the source pieces.";
  box.replaceChildren(el("figure", { class: "map", "data-step": att.step },
    heatmap(weights, att.tgt_pieces, att.src_pieces, -1, false),
    el("figcaption", {}, `update ${att.step}`)));
}

async function main() {
  try {
    const response = await fetch("/model");
    setup(await response.json());
    await restore();
  } catch (e) {
    say(e.message, true);
  }
  document.body.dataset.ready = "yes"; // the hash's view is open: for scripted readers
}

main();
