// Navigation shared by the pages: links, breadcrumbs, and what a page must stop when it is left.
import { h } from "./util.js";

const crumbs = document.getElementById("crumbs");
const live = document.getElementById("live");

// Everything a page started (polling timers, charts) is stopped when the route changes.
let cleanups = [];

export function onLeave(fn) {
  cleanups.push(fn);
}

export function poll(seconds, fn) {
  const timer = setInterval(async () => {
    if (document.hidden) return;
    try {
      await fn();
      live.hidden = false;
      live.textContent = `● live · updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      live.textContent = `● live · ${err.message}`;
    }
  }, seconds * 1000);
  onLeave(() => {
    clearInterval(timer);
    live.hidden = true;
  });
}

export const runHref = (run) => `#/run/${encodeURIComponent(run)}`;
export const rolloutHref = (run, id) => `${runHref(run)}/rollout/${encodeURIComponent(id)}`;
export const rolloutsHref = (run, params = {}) => {
  const q = new URLSearchParams(params).toString();
  return `${runHref(run)}/rollouts${q ? `?${q}` : ""}`;
};

export const compareHref = (runs) => `#/compare?${runs.map((r) => `runs=${encodeURIComponent(r)}`).join("&")}`;

export function setCrumbs(...items) {
  crumbs.replaceChildren(h("a", { href: "#/" }, "Runs"), ...items.flatMap(([text, href]) => [h("span", { class: "sep" }, "›"), href ? h("a", { href }, text) : h("span", {}, text)]));
}

// Runs and forgets the previous page's cleanups; called by the router on every route change.
export function leavePage() {
  for (const fn of cleanups) fn();
  cleanups = [];
  document.getElementById("tip").hidden = true; // a token tooltip must not outlive its page
}
