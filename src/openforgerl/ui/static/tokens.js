// The token view: one training sample, each token coloured by its loss mask, its numbers on hover.
import { api, fmt, h } from "./util.js";

const tip = document.getElementById("tip");

function shown(piece) {
  // Make whitespace visible without losing the layout: the newline still breaks the line.
  return piece.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
}

function describe(s, i, pieces, decoded, callOf) {
  const id = s.input_ids[i];
  const trained = s.loss_mask[i] === 1;
  const rows = [
    ["position", i],
    ["token id", id],
    decoded ? ["text", JSON.stringify(pieces[id] ?? "")] : null,
    ["loss mask", trained ? "1 · sampled by the policy: trained" : "0 · context (prompt, tool output): not trained"],
    ["call", `call ${s.call_seqs[callOf[i]] + 1}`],
  ];
  if (trained) {
    const lp = s.logprobs[i];
    rows.push(["behaviour logprob", `${fmt.num(lp, 4)} (p = ${fmt.num(Math.exp(lp), 3)})`]);
    if (s.policy_versions[i] >= 0) rows.push(["policy version", s.policy_versions[i]]);
    const tl = s.trainer_logprobs?.[i];
    if (tl !== undefined && tl !== null) rows.push([`trainer logprob (step ${s.trainer_step ?? "?"})`, fmt.num(tl, 4)]);
    const w = s.importance_weights?.[i];
    if (w !== undefined && w !== null) rows.push(["importance weight", fmt.num(w, 4)]);
  }
  return rows.filter(Boolean);
}

function showSample(box, s, view) {
  const { pieces, decoded } = view;
  // Each token belongs to the call whose completion span it precedes or falls in.
  const callOf = new Array(s.input_ids.length);
  let start = 0;
  s.completion_spans.forEach(([, end], k) => {
    for (let i = start; i < end; i++) callOf[i] = k;
    start = end;
  });
  for (let i = start; i < callOf.length; i++) callOf[i] = s.completion_spans.length - 1;

  const trained = s.loss_mask.reduce((a, b) => a + b, 0);
  const lps = s.logprobs.filter((_, i) => s.loss_mask[i] === 1);
  const meanLp = lps.length ? lps.reduce((a, b) => a + b, 0) / lps.length : null;
  const stats = h("p", { class: "token-stats" },
    `${fmt.int(s.input_ids.length)} tokens: `, h("span", { class: "tok m1" }, `${fmt.int(trained)} trained`), " ",
    h("span", { class: "tok m0" }, `${fmt.int(s.input_ids.length - trained)} context`),
    ` · mean behaviour logprob of trained tokens ${fmt.num(meanLp, 3)} · reward ${fmt.num(s.reward, 2)}`,
    s.trainer_logprobs ? ` · trainer values from step ${s.trainer_step ?? "?"}` : "");

  const frag = document.createDocumentFragment();
  s.input_ids.forEach((id, i) => {
    const label = decoded ? shown(pieces[id] ?? `⟨${id}⟩`) : `${id}`;
    frag.append(h("span", { class: `tok m${s.loss_mask[i]}${decoded ? "" : " id"}`, dataset: { i } }, label));
  });
  const seq = h("div", { class: `seq${decoded ? "" : " ids"}` }, frag);
  seq.addEventListener("mouseover", (e) => {
    const el = e.target.closest(".tok");
    if (!el) return;
    const rows = describe(s, Number(el.dataset.i), pieces, decoded, callOf);
    tip.replaceChildren(h("table", {}, rows.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, String(v))))));
    tip.hidden = false;
    const r = el.getBoundingClientRect();
    tip.style.left = `${Math.min(window.innerWidth - tip.offsetWidth - 8, r.left)}px`;
    tip.style.top = `${r.bottom + 6 + tip.offsetHeight > window.innerHeight ? r.top - tip.offsetHeight - 6 : r.bottom + 6}px`;
  });
  seq.addEventListener("mouseleave", () => (tip.hidden = true));
  box.replaceChildren(stats, seq);
}

export async function renderTokens(box, run, id) {
  box.replaceChildren(h("p", { class: "muted" }, "Loading tokens…"));
  const view = await api("tokens", { run, id });
  if (!view.samples.length) {
    box.replaceChildren(h("p", { class: "empty" }, "No training samples: no call of this rollout completed."));
    return;
  }
  const legend = h("div", { class: "legend" },
    h("span", { class: "tok m0" }, "context · mask 0"), h("span", { class: "tok m1" }, "sampled · mask 1 (trained)"),
    h("span", { class: "muted" }, view.decoded ? `decoded with ${view.model}` : "token ids: no tokenizer known (pass --model DIR, or name model_dir in the run's config)"));
  const tabs = h("div", { class: "tabs small" });
  const body = h("div", { class: "sample-body" });
  const pick = (index) => {
    [...tabs.children].forEach((b, k) => b.classList.toggle("on", k === index));
    showSample(body, view.samples[index], view);
  };
  view.samples.forEach((s) => tabs.append(h("button", { onclick: () => pick(s.index), title: s.why }, `Sample #${s.index} · branch ${s.branch_id}`)));
  box.addEventListener("pick", (e) => {
    pick(e.detail);
    box.scrollIntoView({ behavior: "smooth" });
  });
  box.replaceChildren(legend, tabs, body);
  pick(0);
}
