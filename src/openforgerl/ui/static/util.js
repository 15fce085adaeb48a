// Small DOM and formatting helpers. Text always goes in through textContent: records hold
// model output and harness input, which must never be parsed as HTML.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export class ApiError extends Error {}

export async function api(path, params = {}) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (Array.isArray(v)) v.forEach((one) => query.append(k, one));
    else if (v !== undefined && v !== null && v !== "") query.set(k, v);
  }
  const response = await fetch(`/api/${path}?${query}`, { headers: { accept: "application/json" } });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new ApiError(body.error?.message || `${response.status} ${response.statusText}`);
  return body;
}

const intFmt = new Intl.NumberFormat("en");

export const fmt = {
  int: (v) => (v === null || v === undefined ? "–" : intFmt.format(v)),
  num: (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits)),
  pct: (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)}%`),
  secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 1) return `${Math.round(v * 1000)} ms`;
    if (v < 120) return `${v.toFixed(1)} s`;
    return `${(v / 60).toFixed(1)} min`;
  },
  when(ts) {
    if (!ts) return "–";
    const ago = Date.now() / 1000 - ts;
    if (ago < 90) return `${Math.max(0, Math.round(ago))} s ago`;
    if (ago < 5400) return `${Math.round(ago / 60)} min ago`;
    return new Date(ts * 1000).toLocaleString();
  },
};

const STATUS_CLASS = {
  closed: "ok", done: "ok", finished: "ok", ok: "ok",
  open: "run", running: "run", active: "run", pending: "muted", idle: "muted", unknown: "muted",
  failed: "bad", interrupted: "warn", cancelled: "bad", infra_failed: "bad", dropped: "warn", error: "bad", aborted: "bad",
};

export function badge(text, title) {
  return h("span", { class: `badge ${STATUS_CLASS[text] || "muted"}`, title }, text);
}

// Reward coloured from red (0) to green (1); unscored rollouts stay grey.
export function rewardCell(reward) {
  if (reward === null || reward === undefined) return h("span", { class: "reward none" }, "–");
  const r = Math.max(0, Math.min(1, reward));
  return h("span", { class: "reward", style: `--r:${r}` }, fmt.num(reward, 2));
}

export function section(title, hint, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), hint ? h("p", { class: "hint" }, hint) : null, children);
}

export function kv(pairs) {
  return h("dl", { class: "kv" }, pairs.filter(([, v]) => v !== undefined).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "–")]));
}

export function jsonBlock(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}
