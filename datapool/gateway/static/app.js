"use strict";
// arlflow data pool UI: plain JS, no framework, no build step. The URL hash picks the view:
//   #/?env=..&round=..   live trajectory list      #/t/<id>   one trajectory      #/batch   batch preview
//   #/rounds?env=..&round=..   per-round charts and one round's groups (inline SVG: nothing loaded from outside)
// All data comes from the JSON API under <this page>/api and is inserted as text (never as HTML): trajectories
// hold arbitrary agent output.

const BASE = location.pathname.replace(/\/+$/, "");  // "/ui" (or "<root path>/ui" behind a proxy)
const KEY_STORAGE = "arlflow.apiKey";
const REFRESH_MS = 3000;
const PAGE_SIZE = 50;
const STATUSES = ["open", "complete", "truncated", "failed"];
const FLAGS = ["truncated", "invalid_action", "retokenized", "tool_failure", "prefix_break"];
let refreshTimer = null;

// ------------------------------------------------------------------------------------------ helpers

/** Create an element: el("a", {href: "#/", "data-testid": "x", onclick: fn}, "text", child). */
function el(tag, attrs = {}, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

/** Create an SVG element, with attributes and children as el() takes them. */
function svg(tag, attrs = {}, ...children) {
  return fill(document.createElementNS("http://www.w3.org/2000/svg", tag), attrs, children);
}

/** Set el()'s attributes and handlers on `node` and append its children (strings as text, never as HTML). */
function fill(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "checked" || name === "value" || name === "selected") node[name] = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

/** A rate in [0, 1] as a percentage with one decimal ("" for none: a round without steps). */
function pct(value) {
  return value === null || value === undefined ? "" : (100 * value).toFixed(1) + "%";
}

/** Epoch seconds as local date and time ("" for none: rows written before schema version 4). */
function when(epochSeconds) {
  return epochSeconds ? new Date(epochSeconds * 1000).toLocaleString() : "";
}

function showMessage(text, isError = false) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = isError ? "error" : "info";
}

function showKeyForm(show) {
  document.getElementById("key-form").hidden = !show;
}

/** Call the JSON API with the stored key; throws Error(OpenAI-style message) on a non-2xx answer. */
async function api(path, options = {}) {
  const headers = {"Content-Type": "application/json"};
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(BASE + "/api" + path, {...options, headers});
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    if (response.status === 401) showKeyForm(true);
    throw new Error(body && body.error ? body.error.message : `${response.status} ${response.statusText}`);
  }
  return body;
}

const post = (path, data) => api(path, {method: "POST", body: JSON.stringify(data)});

// --------------------------------------------------------------------------------------- list view

const FILTERS = [
  {name: "env", label: "env", type: "text", list: "env-options"},
  {name: "round", label: "round", type: "number", min: 0},
  {name: "status", label: "status", options: STATUSES},
  {name: "min_return", label: "return ≥", type: "number", step: "any"},
  {name: "max_return", label: "return ≤", type: "number", step: "any"},
  {name: "flag", label: "flag", options: FLAGS},
  {name: "label", label: "label", type: "text"},
  {name: "excluded", label: "excluded", options: ["true", "false"]},
  {name: "policy_version", label: "policy", type: "text"},
];

function filterInput(spec, value) {
  const testid = "filter-" + spec.name;
  if (spec.options) {
    return el("select", {name: spec.name, "data-testid": testid},
      el("option", {value: ""}, "any"),
      spec.options.map((o) => el("option", {value: o, selected: o === value}, o)));
  }
  return el("input", {name: spec.name, type: spec.type, min: spec.min, step: spec.step, list: spec.list,
                      value: value || "", size: 10, "data-testid": testid});
}

function renderList(view, params) {
  const form = el("form", {class: "filters", "data-testid": "filters", onsubmit: (e) => e.preventDefault()},
    FILTERS.map((spec) => el("label", {}, spec.label, " ", filterInput(spec, params.get(spec.name)))),
    el("datalist", {id: "env-options"}),
    el("label", {}, el("input", {type: "checkbox", id: "live", checked: true, "data-testid": "live"}), " live"));
  const stats = el("p", {class: "stats", "data-testid": "stats"});
  const table = el("table", {class: "trajectories"},
    el("thead", {}, el("tr", {}, ["trajectory", "env", "round", "group", "policy", "status", "return", "won",
                                  "steps", "tokens", "labels", "created"].map((h) => el("th", {}, h)))),
    el("tbody", {"data-testid": "trajectory-rows"}));
  const pager = el("p", {class: "pager"});
  view.append(el("h2", {}, "Trajectories"), form, stats, table, pager);

  let offset = Number(params.get("offset") || 0);
  const currentFilters = () => {
    const query = new URLSearchParams();
    for (const spec of FILTERS) {
      const value = form.elements[spec.name].value.trim();
      if (value !== "") query.set(spec.name, value);
    }
    return query;
  };
  const load = async () => {
    const query = currentFilters();
    query.set("limit", PAGE_SIZE);
    query.set("offset", offset);
    try {
      const [page, counts] = await Promise.all([api("/trajectories?" + query), api("/stats")]);
      fillRows(table.tBodies[0], page.trajectories);
      fillStats(stats, form.querySelector("#env-options"), counts);
      pager.replaceChildren(
        el("button", {type: "button", disabled: offset === 0, onclick: () => move(-PAGE_SIZE)}, "← newer"),
        ` ${offset + 1}–${offset + page.trajectories.length} `,
        el("button", {type: "button", disabled: page.trajectories.length < PAGE_SIZE,
                      onclick: () => move(PAGE_SIZE)}, "older →"));
      showMessage("");
    } catch (err) {
      showMessage(err.message, true);
    }
  };
  const move = (delta) => { offset = Math.max(0, offset + delta); remember(); load(); };
  const remember = () => {  // keep filters in the address (no hashchange: the view is not rebuilt)
    const query = currentFilters();
    if (offset) query.set("offset", offset);
    history.replaceState(null, "", "#/" + (String(query) ? "?" + query : ""));
  };
  form.addEventListener("change", (event) => {
    if (event.target.id === "live") return;
    offset = 0;
    remember();
    load();
  });
  refreshTimer = setInterval(() => {
    if (form.elements.live.checked && !document.hidden) load();
  }, REFRESH_MS);
  load();
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((t) => el("tr",
    {class: t.excluded ? "excluded" : "", "data-testid": "trajectory-row", "data-id": t.trajectory_id},
    el("td", {}, el("a", {href: "#/t/" + encodeURIComponent(t.trajectory_id)}, t.trajectory_id)),
    el("td", {}, t.env), el("td", {}, fmt(t.round)), el("td", {}, t.group_id), el("td", {}, t.policy_version),
    el("td", {}, el("span", {class: "status " + t.status}, t.status)),
    el("td", {class: "num"}, fmt(t.episode_return)), el("td", {}, fmt(t.won)),
    el("td", {class: "num"}, fmt(t.num_steps)), el("td", {class: "num"}, fmt(t.response_tokens)),
    el("td", {}, (t.labels || []).map((l) => el("span", {class: "badge"}, l)),
      t.excluded ? el("span", {class: "badge excluded"}, "excluded") : null),
    el("td", {}, when(t.created_at)))));
  if (!rows.length) tbody.append(el("tr", {}, el("td", {colspan: 12}, "no trajectories match")));
}

function fillStats(node, datalist, stats) {
  const envs = stats.by_env || stats.envs || {};
  datalist.replaceChildren(...Object.keys(envs).map((e) => el("option", {value: e})));
  const parts = [];
  for (const [name, value] of Object.entries(stats)) {
    const title = name.replaceAll("_", " ");
    if (typeof value !== "object" || value === null) parts.push(`${title}: ${fmt(value)}`);
    else if (name.startsWith("by_") && Object.keys(value).length) {
      parts.push(`${title}: ` + Object.entries(value).map(([k, n]) => `${k} ${n}`).join(", "));
    }
  }
  node.textContent = parts.join(" · ");
}

// --------------------------------------------------------------------------------- trajectory view

async function renderTrajectory(view, id) {
  view.append(el("p", {}, el("a", {href: "#/"}, "← all trajectories")));
  let traj;
  try {
    traj = await api("/trajectories/" + encodeURIComponent(id));
  } catch (err) {
    view.append(el("p", {class: "error"}, err.message));
    return;
  }
  const fields = ["env", "split", "round", "group_id", "policy_version", "status", "episode_return", "won",
                  "num_steps", "response_tokens", "wall_time_s", "error"];
  view.append(
    el("h2", {"data-testid": "trajectory-title"}, "Trajectory ", traj.trajectory_id,
      traj.curation.excluded ? el("span", {class: "badge excluded"}, "excluded") : null),
    el("dl", {class: "fields"}, fields.flatMap((f) => [el("dt", {}, f), el("dd", {"data-field": f}, fmt(traj[f]))])),
    el("details", {}, el("summary", {}, "scenario and metadata"),
      el("pre", {}, traj.scenario), el("pre", {}, JSON.stringify(traj.metadata, null, 2))),
    curationControls(traj.trajectory_id, null, traj.curation, "traj"),
    el("h3", {}, `Steps (${traj.steps.length})`),
    ...traj.steps.map((step) => stepCard(traj.trajectory_id, step)));
}

/** Exclude toggle + label + note for a trajectory (stepIndex null) or one step; saved on change. */
function curationControls(trajectoryId, stepIndex, curation, prefix) {
  const exclude = el("input", {type: "checkbox", checked: curation.excluded, "data-testid": prefix + "-exclude"});
  const label = el("input", {type: "text", value: curation.label || "", placeholder: "label", size: 14,
                             "data-testid": prefix + "-label"});
  const note = el("input", {type: "text", value: curation.note || "", placeholder: "note", size: 24,
                            "data-testid": prefix + "-note"});
  const box = el("div", {class: "curation"},
    el("label", {}, exclude, stepIndex === null ? " exclude trajectory" : " exclude step"), label, note,
    el("button", {type: "button", "data-testid": prefix + "-save", onclick: () => save({})}, "save label"));
  const save = async (change) => {
    const body = {step_index: stepIndex, note: note.value, ...change};
    if (label.value.trim() !== "") body.label = label.value.trim();
    try {
      const state = await post("/trajectories/" + encodeURIComponent(trajectoryId) + "/curation", body);
      const now = stepIndex === null ? state.trajectory : state.steps[String(stepIndex)];
      exclude.checked = now.excluded;
      const card = box.closest(".step");
      if (card) card.classList.toggle("excluded", now.excluded);
      showMessage(`saved ${stepIndex === null ? "trajectory" : "step " + stepIndex}`);
    } catch (err) {
      exclude.checked = !exclude.checked;
      showMessage(err.message, true);
    }
  };
  exclude.addEventListener("change", () => save({excluded: exclude.checked}));
  return box;
}

function stepCard(trajectoryId, step) {
  const text = (title, body, testid) => el("div", {class: "text"}, el("h4", {}, title),
                                           el("pre", {"data-testid": testid}, body));
  return el("section", {class: "step" + (step.curation.excluded ? " excluded" : ""),
                        "data-testid": "step", "data-index": step.step_index},
    el("header", {},
      el("strong", {}, "step " + step.step_index),
      el("span", {}, "reward ", el("b", {"data-testid": "step-reward"}, fmt(step.reward))),
      el("span", {}, `tokens ${step.prompt_tokens} prompt / ${step.response_tokens} response`),
      step.mean_logprob === null ? null : el("span", {}, "mean logprob " + fmt(step.mean_logprob)),
      step.tool_calls ? el("span", {}, `tools ${step.tool_successes}/${step.tool_calls} ok`) : null,
      step.flags.map((f) => el("span", {class: "badge flag", "data-testid": "step-flag"}, f))),
    curationControls(trajectoryId, step.step_index, step.curation, "step"),
    el("div", {class: "texts"},
      text("observation", step.observation, "step-observation"),
      text("action", step.action || "(invalid)", "step-action"),
      text("response", step.response_text, "step-response")),
    el("details", {}, el("summary", {}, `prompt (${step.prompt_chars} chars; tail shown first)`),
      el("pre", {}, step.prompt_chars > step.prompt_tail.length ? "…" + step.prompt_tail : step.prompt_tail),
      step.prompt_chars > step.prompt_tail.length
        ? el("details", {}, el("summary", {}, "full prompt"), el("pre", {}, step.prompt_text)) : null));
}

// -------------------------------------------------------------------------------------- batch view

/** {a: 1, dropped: {x: 2}} -> [["a", 1], ["dropped.x", 2]] (one level deep: the batch summary's shape). */
function flatEntries(object) {
  return Object.entries(object).flatMap(([key, value]) => value && typeof value === "object" && !Array.isArray(value)
    ? Object.entries(value).map(([inner, v]) => [`${key}.${inner}`, v]) : [[key, value]]);
}

function renderBatch(view) {
  const form = el("form", {class: "filters", "data-testid": "batch-form"},
    el("label", {}, "algorithm ", el("select", {name: "algorithm", "data-testid": "batch-algorithm"},
      el("option", {value: "grpo"}, "grpo (whole groups)"), el("option", {value: "gigpo"}, "gigpo (step rows)"))),
    el("label", {}, "token budget ", el("input", {name: "token_budget", type: "number", min: 1, value: "8192",
                                                 "data-testid": "batch-budget"})),
    el("label", {}, "seed ", el("input", {name: "seed", type: "number", value: "0", size: 4})),
    el("label", {}, "env ", el("input", {name: "env", type: "text", size: 10})),
    el("label", {}, "round ", el("input", {name: "round", type: "number", min: 0, size: 4})),
    el("button", {type: "submit", "data-testid": "batch-run"}, "preview"));
  const result = el("div", {"data-testid": "batch-result"});
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = {algorithm: form.elements.algorithm.value, token_budget: Number(form.elements.token_budget.value),
                  seed: Number(form.elements.seed.value || 0)};
    if (form.elements.env.value.trim()) body.env = form.elements.env.value.trim();
    if (form.elements.round.value !== "") body.round = Number(form.elements.round.value);
    try {
      const batch = await post("/batch-preview", body);
      result.replaceChildren(
        el("h3", {}, `${batch.algorithm} batch under ${batch.token_budget} tokens`),
        el("dl", {class: "fields"}, flatEntries(batch.summary).flatMap(([k, v]) => [
          el("dt", {}, k.replaceAll("_", " ")), el("dd", {"data-field": k}, fmt(v))])),
        el("table", {}, el("thead", {}, el("tr", {}, ["group", "trajectories", "steps", "tokens"]
          .map((h) => el("th", {}, h)))),
          el("tbody", {}, batch.groups.map((g) => el("tr", {"data-testid": "batch-group"},
            el("td", {}, g.group_id), el("td", {class: "num"}, g.trajectories),
            el("td", {class: "num"}, g.steps), el("td", {class: "num"}, g.tokens))))));
      showMessage("");
    } catch (err) {
      showMessage(err.message, true);
    }
  });
  view.append(el("h2", {}, "Batch preview"),
    el("p", {}, "What the batch builder would emit now (excluded and incomplete data left out; nothing is written)."),
    form, result);
}

// ------------------------------------------------------------------------------------- rounds view

/** The rounds table's columns (the charts draw some of them): [title, value of a round summary, formatter]. */
const ROUND_COLUMNS = [
  ["trajectories", (r) => r.trajectories, fmt],
  ["success", (r) => r.success_rate, pct],
  ["mean return", (r) => r.mean_return, fmt],
  ["truncated episodes", (r) => r.truncated_episode_rate, pct],
  ["failed episodes", (r) => r.failed_episode_rate, pct],
  ["steps", (r) => r.steps, fmt],
  ["invalid actions", (r) => r.invalid_action_rate, pct],
  ["truncated responses", (r) => r.truncated_response_rate, pct],
  ["prompt tokens mean", (r) => r.prompt_tokens && r.prompt_tokens.mean, (v) => fmt(v, 1)],
  ["prompt tokens p95", (r) => r.prompt_tokens && r.prompt_tokens.p95, fmt],
  ["response tokens mean", (r) => r.response_tokens && r.response_tokens.mean, (v) => fmt(v, 1)],
  ["response tokens p95", (r) => r.response_tokens && r.response_tokens.p95, fmt],
];

/** One bar per round (a second, lighter bar per round when `second` is given, e.g. p95 beside the mean); bars
 *  grow from 0, rates on a fixed 0-100% scale, negative values below the zero line. */
function barChart(title, rounds, value, format, {rate = false, second = null, legend = null} = {}) {
  const values = rounds.map(value), extra = second ? rounds.map(second) : [];
  const finite = [...values, ...extra].filter((v) => typeof v === "number");
  const top = rate ? 1 : Math.max(0, ...finite), bottom = rate ? 0 : Math.min(0, ...finite);
  const span = top - bottom || 1, height = 110, pad = 16, slot = second ? 56 : 36;
  const width = Math.max(220, 36 + rounds.length * slot);
  const y = (v) => pad + (top - v) / span * height;
  const bars = rounds.flatMap((r, i) => [[values[i], "bar"], ...(second ? [[extra[i], "bar second"]] : [])]
    .map(([v, cls], k) => {
      if (typeof v !== "number") return null;
      const x = 34 + i * slot + k * 20;
      return svg("g", {},
        svg("rect", {class: cls, x, width: 14, y: Math.min(y(v), y(0)), height: Math.max(1, Math.abs(y(v) - y(0)))},
          svg("title", {}, `round ${r.round}: ${format(v)}`)),
        svg("text", {class: "value", x: x + 7, y: Math.min(y(v), y(0)) - 3}, format(v)));
    }));
  const labels = rounds.map((r, i) => svg("text", {class: "axis", x: 34 + i * slot + (second ? 17 : 7),
                                                   y: pad + height + 13}, "r" + r.round));
  return el("figure", {class: "chart", "data-testid": "round-chart"},
    el("figcaption", {}, title, legend ? el("span", {class: "legend"}, legend) : null),
    svg("svg", {width, height: height + pad + 18, role: "img", "aria-label": title},
      svg("line", {class: "zero", x1: 30, x2: width - 4, y1: y(0), y2: y(0)}),
      svg("text", {class: "scale", x: 2, y: pad + 4}, rate ? "100%" : format(top)),
      bars, labels));
}

/** The returns of one group as dots on a line spanning [lo, hi] (the round's range), the mean as a tick. */
function returnStrip(group, lo, hi) {
  const width = 180, x = (v) => 6 + (hi > lo ? (v - lo) / (hi - lo) : 0.5) * (width - 12);
  return svg("svg", {width, height: 18, class: "strip", role: "img",
                     "aria-label": `returns ${group.returns.map((v) => fmt(v)).join(", ")}`},
    svg("line", {class: "zero", x1: 6, x2: width - 6, y1: 9, y2: 9}),
    group.returns.map((v) => svg("circle", {cx: x(v), cy: 9, r: 3.5}, svg("title", {}, fmt(v)))),
    svg("line", {class: "mean", x1: x(group.mean_return), x2: x(group.mean_return), y1: 2, y2: 16}));
}

async function renderRounds(view, params) {
  const env = params.get("env") || "", round = params.get("round") || "";
  const query = new URLSearchParams();
  if (env) query.set("env", env);
  if (round) query.set("round", round);
  let data, counts;
  try {
    [data, counts] = await Promise.all([api("/rounds?" + query), api("/stats")]);
  } catch (err) {
    view.append(el("p", {class: "error"}, err.message));
    return;
  }
  const rounds = data.rounds;
  const pick = (event) => {  // another env: its rounds, and its latest round's groups
    const value = event.target.value;
    location.hash = "#/rounds" + (value ? "?" + new URLSearchParams({env: value}) : "");
  };
  const form = el("form", {class: "filters", onsubmit: (e) => e.preventDefault()},
    el("label", {}, "env ", el("select", {"data-testid": "rounds-env", onchange: pick},
      el("option", {value: ""}, "any"),
      Object.keys(counts.by_env || {}).map((e) => el("option", {value: e, selected: e === env}, e)))));
  view.append(el("h2", {}, "Rounds"),
    el("p", {}, "Every trajectory the pool holds (curated ones included), by pipeline round. Invalid actions, ",
       "truncated responses and tokens are per step; success and the other rates per episode."), form);
  if (!rounds.length) {
    view.append(el("p", {"data-testid": "rounds-empty"}, "no trajectories" + (env ? ` of env ${env}` : "")));
    return;
  }
  const column = (title) => ROUND_COLUMNS.find((c) => c[0] === title);
  const chart = (title, name, options = {}) => barChart(title, rounds, column(name)[1], column(name)[2], options);
  view.append(
    el("div", {class: "charts"},
      chart("success rate", "success", {rate: true}),
      chart("mean return", "mean return"),
      chart("invalid actions (per step)", "invalid actions", {rate: true}),
      chart("truncated responses (per step)", "truncated responses", {rate: true}),
      chart("truncated episodes", "truncated episodes", {rate: true}),
      chart("prompt tokens per step", "prompt tokens mean",
            {second: column("prompt tokens p95")[1], legend: "mean, p95"}),
      chart("response tokens per step", "response tokens mean",
            {second: column("response tokens p95")[1], legend: "mean, p95"})),
    el("table", {class: "rounds", "data-testid": "rounds-table"},
      el("thead", {}, el("tr", {}, el("th", {}, "round"), ROUND_COLUMNS.map(([title]) => el("th", {}, title)))),
      el("tbody", {}, rounds.map((r) => el("tr", {"data-testid": "round-row", "data-round": r.round},
        el("td", {class: "num"}, el("a", {href: "#/rounds?" + new URLSearchParams(
          env ? {env, round: r.round} : {round: r.round})}, r.round)),
        ROUND_COLUMNS.map(([title, value, format]) => el("td", {class: "num", "data-field": title,
                                                                 "data-value": value(r)}, format(value(r)))))))));

  const groups = data.groups;
  if (!groups.length) {
    view.append(el("p", {"data-testid": "groups-title"}, `round ${data.group_round} has no groups`));
    return;
  }
  const returns = groups.flatMap((g) => g.returns).filter((v) => typeof v === "number");
  const lo = Math.min(...returns), hi = Math.max(...returns);
  view.append(
    el("h3", {"data-testid": "groups-title"}, `Groups of round ${data.group_round}`,
       data.groups_total > groups.length ? ` (first ${groups.length} of ${data.groups_total})` : ""),
    el("p", {}, "Each group's returns (one dot per trajectory, the tick is the mean) on the round's scale, ",
       `${fmt(lo)} to ${fmt(hi)}. A group whose returns are all equal carries no signal for GRPO.`),
    el("table", {class: "groups", "data-testid": "groups-table"},
      el("thead", {}, el("tr", {}, ["group", "env", "trajectories", "won", "min", "mean", "max", "returns"]
        .map((h) => el("th", {}, h)))),
      el("tbody", {}, groups.map((g) => el("tr", {"data-testid": "group-row", "data-group": g.group_id},
        el("td", {}, g.group_id), el("td", {}, g.env),
        el("td", {class: "num"}, g.trajectories), el("td", {class: "num"}, g.won),
        ["min_return", "mean_return", "max_return"].map((f) => el("td", {class: "num", "data-field": f,
                                                                         "data-value": g[f]}, fmt(g[f]))),
        el("td", {}, returnStrip(g, lo, hi)))))));
}

// ------------------------------------------------------------------------------------------ routing

function route() {
  clearInterval(refreshTimer);
  refreshTimer = null;
  const [path, query] = (location.hash.slice(1) || "/").split("?");
  const view = document.getElementById("view");
  view.replaceChildren();
  if (path.startsWith("/t/")) renderTrajectory(view, decodeURIComponent(path.slice(3)));
  else if (path === "/batch") renderBatch(view);
  else if (path === "/rounds") renderRounds(view, new URLSearchParams(query || ""));
  else renderList(view, new URLSearchParams(query || ""));
}

async function start() {
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, document.getElementById("key-input").value.trim());
    showKeyForm(false);
    route();
  });
  window.addEventListener("hashchange", route);
  try {
    const response = await fetch(BASE + "/config");
    const config = response.ok ? await response.json() : {auth_required: true};
    if (config.auth_required && !localStorage.getItem(KEY_STORAGE)) {
      showKeyForm(true);
      showMessage("this gateway needs an API key: type it above (it is kept in this browser's localStorage)");
      return;  // the key form's submit handler shows the view
    }
  } catch (err) {
    showMessage("cannot reach the gateway: " + err.message, true);
  }
  route();
}

start();
