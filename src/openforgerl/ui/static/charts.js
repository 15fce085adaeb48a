// Line charts over training steps (uPlot). Each chart's container carries data-points (the number
// of x values drawn) so tests and users can tell a chart is up to date.
import uPlot from "./vendor/uplot/uPlot.esm.js";
import { h } from "./util.js";

const COLORS = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

// metrics.jsonl keys -> charts: the grouping the package docstring promises the trainer.
export function groupMetrics(keys) {
  const groups = [];
  const reward = keys.filter((k) => k === "reward_mean" || k === "pass_rate");
  if (reward.length) groups.push({ id: "reward", title: "Reward and pass rate", keys: reward, big: true });
  const rest = keys.filter((k) => !reward.includes(k));
  const time = rest.filter((k) => k.startsWith("time_") || k.startsWith("time/"));
  const rate = rest.filter((k) => k.endsWith("_per_s"));
  if (rate.length) groups.push({ id: "throughput", title: "Throughput (per second)", keys: rate });
  if (time.length) groups.push({ id: "time", title: "Time per phase (s)", keys: time });
  // How the training rollouts acted (openforgerl.behaviour): the shares on one chart.
  const acting = rest.filter((k) => k.startsWith("behaviour/") && k.endsWith("_rate"));
  if (acting.length) groups.push({ id: "behaviour", title: "Behaviour: tool errors, recovery, give-ups", keys: acting });
  const grouped = new Set([...time, ...rate, ...acting]);
  for (const k of rest) if (!grouped.has(k)) groups.push({ id: k, title: k, keys: [k] });
  return groups;
}

export class LineChart {
  constructor(container, { title, keys, xLabel = "step", height = 200, xTime = false }) {
    this.keys = keys;
    this.box = h("div", { class: "chart", dataset: { chart: title, points: "0" } });
    container.append(h("div", { class: "chart-card" }, h("h3", {}, title), this.box));
    const series = [{ label: xLabel }];
    keys.forEach((k, i) => series.push({ label: k, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { size: 5 } }));
    this.plot = new uPlot(
      {
        width: Math.max(240, this.box.clientWidth || 400),
        height,
        series,
        scales: { x: { time: xTime } },
        axes: [{ label: xTime ? undefined : xLabel }, { size: 56 }],
        legend: { live: true },
      },
      [[], ...keys.map(() => [])],
      this.box,
    );
    this.resize = () => this.plot.setSize({ width: Math.max(240, this.box.clientWidth), height });
    window.addEventListener("resize", this.resize);
  }

  set(xs, columns) {
    this.plot.setData([xs, ...columns]);
    this.box.dataset.points = String(xs.length);
  }

  // rows: metrics rows ({step, key: value}); one x per row, null where a row lacks a key.
  setRows(rows) {
    this.set(rows.map((r) => r.step), this.keys.map((k) => rows.map((r) => (typeof r[k] === "number" ? r[k] : null))));
  }

  destroy() {
    window.removeEventListener("resize", this.resize);
    this.plot.destroy();
  }
}
