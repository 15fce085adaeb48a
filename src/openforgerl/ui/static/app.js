// The viewer's router and its run pages. Routes live in the URL hash so every view has a link:
//   #/                                  runs
//   #/run/NAME                          one run's dashboard
//   #/run/NAME/rollouts?sort=&page=...  its rollouts
//   #/run/NAME/rollout/ID               one rollout: turns, verifier, samples, tokens
//   #/compare?runs=A&runs=B             evaluations of the same tasks side by side
import { LineChart, groupMetrics } from "./charts.js";
import { comparePage, comparisonsSection, evaluationSections } from "./evals.js";
import { leavePage, onLeave, poll, rolloutHref, rolloutsHref, runHref, setCrumbs } from "./nav.js";
import { renderRollout } from "./rollout.js";
import { api, badge, fmt, h, jsonBlock, kv, rewardCell, section } from "./util.js";

const main = document.getElementById("main");
const FINAL = ["finished", "failed", "interrupted"]; // a run in any other state is polled
let routeToken = 0;

// Sorting 100k rollouts needs the store indexes the viewer does not create unless asked.
async function indexBanner() {
  const info = await api("info");
  const missing = Object.entries(info.missing_indexes);
  const banner = document.getElementById("banner");
  banner.hidden = !missing.length;
  banner.textContent = missing.length
    ? `Sorting may be slow: ${missing.map(([p, names]) => `${p} lacks ${names.join(", ")}`).join("; ")}. ` +
      "Run `openforge view --create-indexes` once to add them."
    : "";
}

async function route() {
  leavePage();
  const token = ++routeToken;
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const page = h("div", { class: "page" });
  main.replaceChildren(page);
  try {
    if (parts[0] === "run" && parts.length === 2) await runPage(page, parts[1]);
    else if (parts[0] === "run" && parts[2] === "rollouts") await rolloutsPage(page, parts[1], new URLSearchParams(query));
    else if (parts[0] === "run" && parts[2] === "rollout") await renderRollout(page, parts[1], parts[3]);
    else if (parts[0] === "compare") await comparePage(page, new URLSearchParams(query).getAll("runs"));
    else await runsPage(page);
    await indexBanner();
  } catch (err) {
    if (token === routeToken) page.replaceChildren(h("div", { class: "error" }, h("strong", {}, "Could not load this page: "), err.message));
  }
}

// -- runs ---------------------------------------------------------------------------------------
async function runsPage(page) {
  setCrumbs();
  const { runs } = await api("runs");
  page.append(
    h("h1", {}, "Runs"),
    h("p", { class: "lead" }, "A run is a training or evaluation job: rollouts (a harness solving a task through the gateway, scored by a verifier), its training curves, and its eval reports. Pick one."),
  );
  if (!runs.length) {
    page.append(h("p", { class: "empty" }, "No runs found. Point the viewer at a gateway store (--store) or a runs folder (--runs)."));
    return;
  }
  const row = (r, label, cls, href) => {
    const m = r.last_metrics || {};
    const reward = m.reward_mean ?? r.totals?.reward_mean ?? r.report?.reward_mean;
    const pass = m.pass_rate ?? r.totals?.pass_rate ?? r.report?.pass_rate;
    const status = r.status || {};
    return h("tr", { class: `${cls}${href ? " link" : ""}`, dataset: { run: r.name || "" }, onclick: href ? () => (location.hash = href) : undefined },
      h("td", {}, href ? h("a", { href }, label) : label),
      h("td", {}, badge(status.state, status.error || `source: ${status.source}`)),
      h("td", { class: "num" }, r.steps ? fmt.int(r.steps) : "–"),
      h("td", { class: "num" }, rewardCell(reward)),
      h("td", { class: "num" }, fmt.pct(pass)),
      h("td", { class: "num" }, fmt.int(r.totals?.rollouts ?? r.report?.rollouts ?? null)),
      h("td", {}, fmt.when(status.changed_at || r.totals?.last_closed)));
  };
  // A run, then its phases (the demo's model, teacher, SFT, RL, evaluations), each with its state.
  const rows = runs.flatMap((r) => [
    row(r, r.name, "run-row", runHref(r.name)),
    ...(r.phases || []).map((p) => row({ ...p, name: p.run }, h("span", { class: "phase-name" }, "↳ ", p.phase), "phase-row", p.run ? runHref(p.run) : null)),
  ]);
  page.append(h("table", { class: "grid runs" },
    h("thead", {}, h("tr", {}, ["Run / phase", "Status", "Steps", "Reward", "Pass rate", "Rollouts", "Updated"].map((t) => h("th", {}, t)))),
    h("tbody", {}, rows)));
}

// -- one run ------------------------------------------------------------------------------------
function kpi(label, value, hint) {
  return h("div", { class: "kpi", title: hint }, h("div", { class: "kpi-label" }, label), h("div", { class: "kpi-value" }, value));
}

function runTabs(run, active, total, info) {
  if (info && !info.store) return h("div", { class: "tabs" }, h("a", { href: runHref(run), class: "on" }, "Overview"));
  // A trainer's run: its rollouts tab is its last step's (each step's are in the Steps table).
  const of = info?.step_runs?.length ? ` of ${info.run_id}` : "";
  return h("div", { class: "tabs" },
    h("a", { href: runHref(run), class: active === "overview" ? "on" : "" }, "Overview"),
    h("a", { href: rolloutsHref(run), class: active === "rollouts" ? "on" : "" }, `Rollouts${of}${total !== undefined ? ` (${fmt.int(total)})` : ""}`));
}

// Breadcrumbs of a run: the run it is a phase or a step of first.
function runCrumbs(run, name, ...rest) {
  const up = run.step_of || run.parent;
  if (!up) return setCrumbs([name, rest.length ? runHref(name) : null], ...rest);
  return setCrumbs([up, runHref(up)], [name.slice(up.length).replace(/^[/#]/, ""), rest.length ? runHref(name) : null], ...rest);
}

function phasesSection(phases) {
  if (!phases?.length) return null;
  return section("Phases", "What the run did, in order, each with its state from the run's own record (status.json).",
    h("table", { class: "grid phases" },
      h("thead", {}, h("tr", {}, ["phase", "status"].map((t) => h("th", {}, t)), ["seconds", "reward", "pass@1 / pass rate", "rollouts"].map((t) => h("th", { class: "num" }, t)))),
      h("tbody", {}, phases.map((p) => {
        const m = p.last_metrics || {};
        return h("tr", { dataset: { phase: p.phase } },
          h("td", {}, p.run ? h("a", { href: runHref(p.run) }, p.phase) : p.phase),
          h("td", {}, badge(p.status.state, p.status.error || `source: ${p.status.source}`)),
          h("td", { class: "num" }, fmt.secs(p.status.seconds ?? (p.status.finished_at && p.status.started_at ? p.status.finished_at - p.status.started_at : null))),
          h("td", { class: "num" }, rewardCell(m.reward_mean ?? p.report?.reward_mean ?? p.totals?.reward_mean)),
          h("td", { class: "num" }, fmt.pct(m.pass_rate ?? p.report?.pass_rate ?? p.totals?.pass_rate)),
          h("td", { class: "num" }, fmt.int(p.totals?.rollouts ?? p.report?.rollouts ?? null)));
      }))));
}

// A trainer's steps: one run_id per step in its store, each step's rollouts a link away.
function stepsSection(steps) {
  if (!steps?.length) return null;
  return section("Steps", "Each training step's rollouts (the gateway records them under one run_id per step).",
    h("table", { class: "grid steps" },
      h("thead", {}, h("tr", {}, h("th", {}, "step"), ["rollouts", "mean reward", "pass rate"].map((t) => h("th", { class: "num" }, t)))),
      h("tbody", {}, steps.map((s) => h("tr", { class: "link", onclick: () => (location.hash = rolloutsHref(s.name)) },
        h("td", {}, h("a", { href: rolloutsHref(s.name) }, s.run_id)),
        h("td", { class: "num" }, fmt.int(s.totals?.rollouts)),
        h("td", { class: "num" }, rewardCell(s.totals?.reward_mean)),
        h("td", { class: "num" }, fmt.pct(s.totals?.pass_rate)))))));
}

async function runPage(page, name) {
  setCrumbs([name]);
  const [run, metrics] = await Promise.all([api("run", { run: name }), api("metrics", { run: name })]);
  runCrumbs(run, name);
  const head = h("div", { class: "kpis" });
  page.append(h("h1", {}, name, " ", h("span", { id: "run-state" }, badge(run.status.state))), runTabs(name, "overview", run.totals?.rollouts, run), head);
  page.append(phasesSection(run.phases) || [], comparisonsSection(run.comparisons) || [], stepsSection(run.step_runs) || []);
  const own = run.evals.find((e) => e.path === "report.json");
  if (own) page.append(...evaluationSections(name, own.report));

  const curves = h("div", { class: "charts" });
  const rows = metrics.rows;
  // A run made of phases and without curves of its own (the demo) shows its phases instead.
  if (rows.length || (!run.phases?.length && !own)) {
    page.append(section("Training curves", "One point per training step, read from metrics.jsonl in the run folder; hover a chart for values.", curves));
  }
  let charts = [];
  let keys = [];
  const drawCurves = () => {
    const now = [...new Set(rows.flatMap((r) => Object.keys(r)))].filter((k) => k !== "step");
    if (now.join() !== keys.join()) {
      charts.forEach((c) => c.destroy());
      curves.replaceChildren();
      keys = now;
      charts = groupMetrics(keys).map((g) => new LineChart(curves, { ...g, height: g.big ? 260 : 180 }));
      curves.classList.toggle("empty-box", !charts.length);
      if (!charts.length) curves.append(h("p", { class: "empty" }, "No training metrics yet: a training run appends one line per step to metrics.jsonl."));
    }
    charts.forEach((c) => c.setRows(rows));
  };
  drawCurves();
  onLeave(() => charts.forEach((c) => c.destroy()));

  const throughputBox = h("div", { class: "charts" });
  if (run.store) page.append(section("Rollouts finished per minute", "From the gateway store: when each rollout was closed.", throughputBox));
  const throughput = new LineChart(throughputBox, { title: "rollouts / min", keys: ["rollouts per minute"], xLabel: "time", xTime: true, height: 160 });
  onLeave(() => throughput.destroy());

  const fill = (r) => {
    const m = r.last_metrics || {};
    const t = r.totals;
    head.replaceChildren(
      kpi("Status", badge(r.status.state), `source: ${r.status.source}`),
      kpi("Steps", r.steps ? fmt.int(r.steps) : "–", "training steps in metrics.jsonl"),
      kpi("Reward", rewardCell(m.reward_mean ?? t?.reward_mean ?? r.report?.reward_mean), m.reward_mean !== undefined ? "reward_mean of the last step" : "mean reward of the run's scored rollouts"),
      kpi("Pass rate", fmt.pct(m.pass_rate ?? t?.pass_rate ?? r.report?.pass_rate), "share of rollouts with reward ≥ 1"),
      kpi("Rollouts", t ? `${fmt.int(t.scored)} scored / ${fmt.int(t.rollouts)}` : "–"),
      kpi("Runner", Object.entries(r.progress).map(([k, v]) => `${k} ${v}`).join(" · ") || "–", "the runner's own record (runner.db)"),
      ...(run.phases?.length ? [kpi("Phases", `${run.phases.filter((p) => p.status.state === "finished").length} of ${run.phases.length} finished`, "from the run's status.json")] : []));
    document.getElementById("run-state")?.replaceChildren(badge(r.status.state));
    const tp = t?.throughput;
    if (tp) throughput.set(tp.t, [tp.per_minute]);
  };
  fill(run);

  // A phase without eval reports (SFT, RL in the demo) says nothing about them.
  if ((!own || run.evals.length > 1) && (run.evals.length || !run.parent)) page.append(evalSection(run.evals));
  page.append(section("Configuration", null, kv([
    ["run folder", run.folder], ["store", run.store], ["run_id", run.run_id],
    ["tokenizer", run.model || "none: token ids are shown undecoded (pass --model DIR)"]]),
    Object.keys(run.config).length ? jsonBlock(run.config) : h("p", { class: "empty" }, "No config.json or config.yaml in the run folder.")));

  if (!FINAL.includes(run.status.state)) {
    poll(run.poll_seconds, async () => {
      const last = rows.length ? rows[rows.length - 1].step : undefined;
      const [fresh, more] = await Promise.all([api("run", { run: name }), api("metrics", { run: name, after: last })]);
      rows.push(...more.rows);
      drawCurves();
      fill(fresh);
    });
  }
}

// Eval reports side by side (before SFT / after SFT / after RL ...), best value per row in bold.
function evalSection(evals) {
  if (!evals.length) return section("Evaluations", null, h("p", { class: "empty" }, "No eval reports: openforge eval writes report.json; a trainer adds eval-*/report.json or evals.jsonl."));
  const ks = [...new Set(evals.flatMap((e) => Object.keys(e.report.summary?.["pass@k"] || {})))].sort((a, b) => a - b);
  const est = (e, path) => path.reduce((o, k) => o?.[k], e.report.summary);
  const metric = (label, get, best = true) => ({ label, get, best });
  const rows = [
    metric("mean reward", (e) => est(e, ["mean_reward"])),
    ...ks.map((k) => metric(`pass@${k}`, (e) => est(e, ["pass@k", k]))),
    ...ks.map((k) => metric(`pass^${k}`, (e) => est(e, ["pass^k", k]))),
  ];
  const cell = (iv) => (iv ? h("span", {}, fmt.num(iv.estimate), h("span", { class: "ci" }, ` [${fmt.num(iv.low, 2)}, ${fmt.num(iv.high, 2)}]`)) : "–");
  const body = rows.map((m) => {
    const values = evals.map(m.get);
    const top = Math.max(...values.map((v) => v?.estimate ?? -Infinity));
    return h("tr", {}, h("th", {}, m.label), values.map((v) => h("td", { class: `num${v && v.estimate === top && evals.length > 1 ? " best" : ""}` }, cell(v))));
  });
  const plain = [
    ["tasks", (e) => e.report.tasks], ["harness", (e) => e.report.harness],
    ["rollouts (scored)", (e) => `${e.report.rollouts ?? "–"} (${e.report.scored ?? "–"})`],
    ["outcomes", (e) => Object.entries(e.report.outcomes || {}).map(([k, v]) => `${k}: ${v}`).join(", ")],
    ["tokens (prompt / completion)", (e) => `${fmt.int(e.report.tokens?.prompt)} / ${fmt.int(e.report.tokens?.completion)}`],
    // What the rollouts did, read from their conversations (openforgerl.behaviour).
    ["rollouts that met a tool error", (e) => e.report.acting?.all?.rollouts_with_errors],
    ["recovered after an error", (e) => fmt.pct(e.report.acting?.all?.recovery_rate)],
    ["gave up after an error", (e) => fmt.pct(e.report.acting?.all?.gave_up_rate)],
    ["read back its own write", (e) => fmt.pct(e.report.acting?.all?.self_verification_rate)],
    ["time", (e) => fmt.secs(e.report.seconds)],
  ];
  return section("Evaluations", "Each column is one eval report; 95% confidence intervals in brackets, the best estimate in bold.",
    h("table", { class: "grid evals" },
      h("thead", {}, h("tr", {}, h("th", {}), evals.map((e) => h("th", {}, e.name, e.step !== null && e.step !== undefined ? h("span", { class: "ci" }, ` step ${e.step}`) : null)))),
      h("tbody", {}, body, plain.map(([label, get]) => h("tr", {}, h("th", {}, label), evals.map((e) => h("td", {}, get(e) ?? "–")))))));
}

// -- rollouts table -----------------------------------------------------------------------------
const COLUMNS = [
  ["task", "Task", "task"], ["dialect", "Harness / dialect", "dialect"], ["status", "Status", "status"],
  ["reward", "Reward", "reward"], ["turns", "Calls", "turns"], ["tokens", "Tokens", "tokens"],
  ["seconds", "Time", "seconds"], ["failure", "Failure", "failure"], ["created", "Started", "created"],
];

async function rolloutsPage(page, name, params) {
  const state = Object.fromEntries(params);
  const go = (changes) => {
    const next = { ...state, ...changes };
    for (const k of Object.keys(next)) if (next[k] === "" || next[k] === undefined) delete next[k];
    location.hash = rolloutsHref(name, next);
  };
  const [data, run] = await Promise.all([api("rollouts", { run: name, ...state }), api("run", { run: name })]);
  runCrumbs(run, name, ["Rollouts"]);
  page.append(h("h1", {}, name), runTabs(name, "rollouts", data.total, run));

  const select = (key, label, values) =>
    h("label", {}, label, h("select", { onchange: (e) => go({ [key]: e.target.value, page: "" }) },
      h("option", { value: "" }, "any"), values.map((v) => h("option", { value: v, selected: state[key] === v }, v))));
  const input = (key, label, attrs) =>
    h("label", {}, label, h("input", { value: state[key] || "", onchange: (e) => go({ [key]: e.target.value.trim(), page: "" }), ...attrs }));
  page.append(h("div", { class: "filters" },
    input("task", "Task contains", { placeholder: "task id", size: 14 }),
    select("status", "Status", data.facets.status), select("dialect", "Dialect", data.facets.dialect),
    select("failure", "Failure", data.facets.failure),
    input("min_reward", "Reward ≥", { type: "number", step: "any", size: 4 }),
    input("max_reward", "≤", { type: "number", step: "any", size: 4 }),
    h("label", {}, "Per page", h("select", { onchange: (e) => go({ page_size: e.target.value, page: "" }) },
      [25, 50, 100, 200].map((n) => h("option", { value: n, selected: String(data.page_size) === String(n) }, n))))));

  const sortKey = data.sort.replace(/^-/, "");
  const desc = data.sort.startsWith("-");
  const header = COLUMNS.map(([key, label]) => h("th", {
    class: `sortable${sortKey === key ? " sorted" : ""}`, "aria-sort": sortKey === key ? (desc ? "descending" : "ascending") : "none",
    title: "Sort by this column (again: reverse)",
    onclick: () => go({ sort: sortKey === key && !desc ? `-${key}` : key, page: "" }),
  }, label, h("span", { class: "arrow" }, sortKey === key ? (desc ? " ▼" : " ▲") : "")));
  const tbody = h("tbody");
  const table = h("table", { class: "grid rollouts" }, h("thead", {}, h("tr", {}, header)), tbody);
  const pager = h("div", { class: "pager" });
  page.append(table, pager);

  const fill = (d) => {
    tbody.replaceChildren(...d.rows.map((r) => h("tr", { class: "link", dataset: { id: r.id }, onclick: () => (location.hash = rolloutHref(name, r.id)) },
      h("td", {}, h("a", { href: rolloutHref(name, r.id) }, r.task_id || "(no task)")),
      h("td", {}, [r.harness, r.dialect].filter(Boolean).join(" · ") || "–"),
      h("td", {}, badge(r.status)),
      h("td", { class: "num" }, rewardCell(r.reward)),
      h("td", { class: "num" }, fmt.int(r.turns)),
      h("td", { class: "num", title: `${fmt.int(r.sampled)} of them sampled by the policy` }, fmt.int(r.tokens)),
      h("td", { class: "num" }, fmt.secs(r.seconds)),
      h("td", { class: "failure" }, r.failure || ""),
      h("td", {}, fmt.when(r.created_at)))));
    if (!d.rows.length) tbody.append(h("tr", {}, h("td", { colspan: COLUMNS.length, class: "empty" }, "No rollouts match.")));
    const pages = Math.max(1, Math.ceil(d.total / d.page_size));
    const from = d.total ? (d.page - 1) * d.page_size + 1 : 0;
    const to = Math.min(d.total, d.page * d.page_size);
    const btn = (label, p, off) => h("button", { disabled: off, onclick: () => go({ page: p }) }, label);
    pager.replaceChildren(
      btn("« first", 1, d.page <= 1), btn("‹ prev", d.page - 1, d.page <= 1),
      h("span", {}, `${fmt.int(from)}–${fmt.int(to)} of ${fmt.int(d.total)} · page ${fmt.int(d.page)} of ${fmt.int(pages)}`),
      btn("next ›", d.page + 1, d.page >= pages), btn("last »", pages, d.page >= pages));
  };
  fill(data);
  if (!FINAL.includes(run.status.state)) {
    poll(run.poll_seconds, async () => fill(await api("rollouts", { run: name, ...state })));
  }
}

window.addEventListener("hashchange", route);
route();
