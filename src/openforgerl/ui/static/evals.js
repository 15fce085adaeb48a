// Evaluations: one evaluation in full (pass@k / pass^k with intervals, per tag, per task, failures,
// behaviour) and the comparison of two or more evaluations of the same tasks (paired differences).
import { compareHref, rolloutsHref, runHref, setCrumbs } from "./nav.js";
import { api, fmt, h, section } from "./util.js";

const short = (name) => name.split("/").slice(-1)[0];
const signed = (v) => (v === null || v === undefined ? "–" : `${v >= 0 ? "+" : "−"}${Math.abs(v).toFixed(3)}`);

export function interval(iv) {
  return iv ? h("span", {}, fmt.num(iv.estimate), h("span", { class: "ci" }, ` [${fmt.num(iv.low)}, ${fmt.num(iv.high)}]`)) : "–";
}

// A paired difference: its estimate and interval, green when the interval is above 0, red below.
export function difference(d) {
  if (!d) return h("td", { class: "num" }, "–");
  const sure = d.low > 0 ? "up" : d.high < 0 ? "down" : "";
  return h("td", { class: `num diff ${sure}`, dataset: { estimate: d.estimate, low: d.low, high: d.high } },
    signed(d.estimate), h("span", { class: "ci" }, ` [${signed(d.low)}, ${signed(d.high)}]`));
}

// What the rollouts did, read from their conversations (openforgerl.behaviour).
export const BEHAVIOUR = [
  ["tool calls per rollout", (a) => fmt.num(a?.tool_calls_mean, 2)],
  ["tool errors per rollout", (a) => fmt.num(a?.tool_errors_mean, 2)],
  ["rollouts that met a tool error", (a) => a?.rollouts_with_errors ?? "–"],
  ["recovered after an error", (a) => fmt.pct(a?.recovery_rate)],
  ["gave up after an error", (a) => fmt.pct(a?.gave_up_rate)],
  ["read back its own write", (a) => fmt.pct(a?.self_verification_rate)],
];

// One evaluation run's report.json in full.
export function evaluationSections(name, report) {
  const s = report.summary;
  if (!s?.per_task) return [];
  const ks = Object.keys(s["pass@k"] || {}).sort((a, b) => a - b);
  const headline = h("table", { class: "grid evals eval-summary" },
    h("thead", {}, h("tr", {}, h("th", {}, "metric"), h("th", {}, `estimate [${Math.round((s.confidence || 0.95) * 100)}% interval]`))),
    h("tbody", {},
      [["mean reward", s.mean_reward], ...ks.map((k) => [`pass@${k}`, s["pass@k"][k]]), ...ks.map((k) => [`pass^${k}`, s["pass^k"]?.[k]])]
        .map(([label, iv]) => h("tr", { dataset: { metric: label } }, h("th", {}, label), h("td", { class: "num" }, interval(iv))))));
  const out = [section("Evaluation",
    `${s.tasks} tasks × ${report.n} runs (${report.rollouts} rollouts, ${report.scored} scored) of ${report.tasks} with the ${report.harness} harness` +
      `${report.temperature !== undefined ? `, temperature ${report.temperature}` : ""}. Intervals: ${s.interval?.method || "bootstrap"} (${s.interval?.resamples ?? "?"} resamples).`,
    headline)];

  const tags = Object.entries(report.by_tag || {});
  const actTags = report.acting?.by_tag || {};
  if (tags.length) {
    out.push(section("Per task family (tag)", "Each figure is the mean over the tag's tasks, as the overall ones are.",
      h("table", { class: "grid by-tag" },
        h("thead", {}, h("tr", {}, ["tag", "tasks", "runs", "mean reward", ...ks.map((k) => `pass@${k}`), "met an error", "recovered"].map((t) => h("th", {}, t)))),
        h("tbody", {}, tags.map(([tag, v]) => h("tr", { dataset: { tag } }, h("th", {}, tag),
          h("td", { class: "num" }, v.tasks), h("td", { class: "num" }, v.runs), h("td", { class: "num" }, fmt.num(v.mean_reward)),
          ks.map((k) => h("td", { class: "num" }, fmt.num(v["pass@k"]?.[k]))),
          h("td", { class: "num" }, actTags[tag]?.rollouts_with_errors ?? "–"), h("td", { class: "num" }, fmt.pct(actTags[tag]?.recovery_rate))))))));
  }

  const act = report.acting?.all;
  if (act) {
    out.push(section("Behaviour", "What the rollouts did, read from each recorded conversation: tool errors met, recoveries (the failed file read again), give-ups, a write read back.",
      h("table", { class: "grid behaviour-table" }, h("tbody", {}, BEHAVIOUR.map(([label, get]) => h("tr", {}, h("th", {}, label), h("td", { class: "num" }, get(act))))))));
  }

  const outcomes = Object.entries(report.outcomes || {});
  const failed = outcomes.filter(([o]) => o !== "ok");
  const missing = report.tasks_without_k_scored_runs || [];
  out.push(section("Failures", "Rollouts whose harness or verifier did not finish normally, by outcome (a wrong answer is outcome ok with reward 0); each links to its rollouts.",
    failed.length || missing.length
      ? h("ul", { class: "failures" },
          failed.map(([o, n]) => h("li", {}, h("a", { href: rolloutsHref(name, { failure: o }) }, o), `: ${n} rollouts`)),
          missing.length ? h("li", {}, `tasks without ${report.k} scored runs (left out of the figures): ${missing.join(", ")}`) : null)
      : h("p", { class: "empty" }, `None: all ${report.rollouts} rollouts ended normally (${outcomes.map(([o, n]) => `${o}: ${n}`).join(", ")}).`)));

  out.push(section("Per task", "Each task's runs and successes; its link opens its rollouts.",
    h("table", { class: "grid per-task" },
      h("thead", {}, h("tr", {}, ["task", "runs", "successes", "mean reward", ...ks.map((k) => `pass@${k}`), ...ks.map((k) => `pass^${k}`), ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, s.per_task.map((t) => h("tr", { dataset: { task: t.task_id } },
        h("td", {}, t.task_id), h("td", { class: "num" }, t.runs), h("td", { class: "num" }, t.successes),
        h("td", { class: "num" }, fmt.num(t.mean_reward)),
        ks.map((k) => h("td", { class: "num" }, fmt.num(t["pass@k"][k]))), ks.map((k) => h("td", { class: "num" }, fmt.num(t["pass^k"][k]))),
        h("td", {}, h("a", { href: rolloutsHref(name, { task: t.task_id }) }, "rollouts"))))))));
  return out;
}

// The comparisons a run's evaluation phases allow: each group evaluated the same tasks the same way.
export function comparisonsSection(groups) {
  if (!groups?.length) return null;
  return section("Comparisons", "Evaluations of the same tasks, side by side: each one's scores and the paired difference between them, per task family and per task.",
    h("ul", { class: "comparisons" }, groups.map((g) => h("li", {},
      h("a", { href: compareHref(g.runs) }, g.runs.map(short).join(" → ")), h("span", { class: "muted" }, ` · ${g.label}`)))));
}

export async function comparePage(page, names) {
  setCrumbs(["Compare"]);
  const c = await api("compare", { runs: names });
  if (c.parent) setCrumbs([c.parent, runHref(c.parent)], ["Compare"]);
  const heads = () => [c.runs.map((r) => h("th", { class: "num" }, h("a", { href: runHref(r), title: r }, short(r)))),
    c.pairs.map((p) => h("th", { class: "num", title: `${p.to} minus ${p.from}, paired by task` }, `${short(p.to)} − ${short(p.from)}`))];
  page.append(h("h1", {}, "Comparison: ", c.runs.map(short).join(" → ")),
    h("p", { class: "lead" }, `The same tasks evaluated ${c.runs.length} times (${c.reports.map((r, i) => `${short(c.runs[i])}: ${r.tasks} with ${r.harness}, ${r.n} runs per task`).join("; ")}). ` +
      `Each difference is later minus earlier, with its ${c.interval}; green when the whole interval is above zero, red when below.`));
  page.append(section("Overall", "Each evaluation's estimate [95% interval] as its report.json has it, then the paired differences.",
    h("table", { class: "grid evals compare-overall" },
      h("thead", {}, h("tr", {}, h("th", {}, "metric"), heads())),
      h("tbody", {}, c.overall.map((m) => h("tr", { dataset: { metric: m.metric } }, h("th", {}, m.metric),
        m.values.map((v) => h("td", { class: "num" }, interval(v))), m.differences.map(difference)))))));
  if (c.by_tag.length) {
    page.append(section(`Per task family (tag): ${c.metric}`, "The mean over the family's tasks; the difference paired over them.",
      h("table", { class: "grid evals compare-tags" },
        h("thead", {}, h("tr", {}, h("th", {}, "tag (tasks)"), heads())),
        h("tbody", {}, c.by_tag.map((t) => h("tr", { dataset: { tag: t.tag } }, h("th", {}, `${t.tag} (${t.tasks})`),
          t.values.map((v) => h("td", { class: "num" }, fmt.num(v))), t.differences.map(difference)))))));
  }
  page.append(section(`Per task: ${c.metric}`, "Successes of runs, and the task's rollouts under each model.",
    h("table", { class: "grid evals compare-tasks" },
      h("thead", {}, h("tr", {}, h("th", {}, "task"), heads())),
      h("tbody", {}, c.by_task.map((t) => h("tr", { dataset: { task: t.task_id } },
        h("th", {}, t.task_id, t.tags.length ? h("span", { class: "ci" }, ` ${t.tags.join(", ")}`) : null),
        t.values.map((v, i) => h("td", { class: "num" }, fmt.num(v), h("span", { class: "ci" }, ` ${t.successes[i]}/${t.runs[i]} `),
          h("a", { class: "task-rollouts", href: rolloutsHref(c.runs[i], { task: t.task_id }), title: `${t.task_id} in ${c.runs[i]}` }, "rollouts"))),
        t.differences.map((d) => h("td", { class: `num diff ${d > 0 ? "up" : d < 0 ? "down" : ""}` }, signed(d)))))))));
  page.append(section("Behaviour", "What the rollouts did, read from their conversations (openforgerl.behaviour).",
    h("table", { class: "grid evals compare-behaviour" },
      h("thead", {}, h("tr", {}, h("th", {}), c.runs.map((r) => h("th", { class: "num" }, short(r))))),
      h("tbody", {},
        BEHAVIOUR.map(([label, get]) => h("tr", {}, h("th", {}, label), c.behaviour.map((a) => h("td", { class: "num" }, get(a))))),
        h("tr", {}, h("th", {}, "outcomes"), c.reports.map((r) => h("td", { class: "num" }, Object.entries(r.outcomes || {}).map(([k, v]) => `${k}: ${v}`).join(", "))))))));
}
