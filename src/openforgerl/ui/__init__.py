"""`openforge view`: a read-only trace viewer and run dashboard in the browser.

A Starlette app (`app.py`) serves a JSON API under /api and a front end of plain ES modules
(`static/`, no build step; uPlot vendored from its npm tarball, see static/vendor/README.md).
Read-only, and through the store's API only (the viewer holds no SQL): a store is read with
`openforgerl.store.view.StoreView`, a runner's runner.db with `openforgerl.store.run_state`, both
opened with SQLite `mode=ro` URIs; `--create-indexes` is the one opt-in write (the store's
`VIEWER_INDEXES`). Loopback by default; a token is required on any other address.

What the viewer reads (the contract with the runner and the trainer):

- `--store PATH`: a gateway store (`openforgerl.store`). Each distinct `rollouts.run_id` is a run.
- `--runs DIR`: run folders: DIR itself, each child of DIR, and each child's `eval-*` folders, when
  they hold any of the files below. A folder's name is the run_id its rollouts carry in `--store`,
  unless the folder has its own `gateway.db` (as `openforge eval` writes), which is then read.
- `<run>/metrics.jsonl`: one JSON object per line per training step, appended as steps finish:
  `{"step": 3, "reward_mean": 0.4, "pass_rate": 0.35, "loss": 0.12, "kl": 0.01, ...}`.
  `step` (a number) is required; every other numeric field is plotted, so the trainer can add
  metrics freely. Charts: `reward_mean` and `pass_rate` together; fields named `time_*` (seconds
  per phase) together; `*_per_s` fields (throughput, e.g. `tokens_per_s`) together; each other
  field on its own (loss, kl, clip_fraction, importance_weight_mean, tokens, ...). Non-numbers are
  ignored, NaN/inf and null are gaps, an unfinished last line waits for its newline, and a step
  logged twice (a resumed run) shows its last line.
- `<run>/config.json` or `config.yaml`: shown as is. Its `model_dir`, `model_path`, `model` or
  `policy.model`, when it is a directory with a tokenizer, decodes the token view (`--model DIR`
  overrides it for every run).
- `<run>/status.json`: `{"state": "running" | "done" | "failed", ...}`, shown as the run's status
  when present; otherwise the status is inferred (files changed in the last two minutes: active).
- `<run>/report.json` (`openforge eval`), `<run>/eval-*/report.json`, and `<run>/evals.jsonl`:
  eval reports shown side by side. `evals.jsonl` lines name the trainer's evals in order:
  `{"name": "after SFT", "step": 200, "path": "eval-after-sft"}` (a folder or a report.json,
  relative to the run) or with the report inline as `"report": {...}`. Unlisted `eval-*` folders
  follow, oldest first.
- `<run>/runner.db`: the runner's per-rollout record (outcome, verifier details, harness tail,
  seconds per phase), joined to the store's rollouts by gateway rollout id.
- `<run>/token_logprobs.jsonl` (optional, from the trainer): per-token values of a training sample,
  `{"step": 3, "rollout_id": "...", "call_id": 17, "trainer_logprobs": [...],
  "importance_weights": [...]}`, where `call_id` is the sample's first call and both lists are
  aligned with the sample's input_ids (null where the loss mask is 0). Shown on hover.

The API (GET only; errors are `{"error": {"status", "message", "param"}}` with a 4xx status):
`/api/info`, `/api/runs`, `/api/run?run=`, `/api/metrics?run=&after=STEP`,
`/api/rollouts?run=&page=&page_size=&sort=[-]KEY&status=&task=&dialect=&failure=&min_reward=&max_reward=`,
`/api/rollout?run=&id=`, `/api/tokens?run=&id=`, `/api/images/DIGEST?run=`. The front end polls an
active run every few seconds.

`/api/rollout` gives the rollout (`RolloutRow.public()`) and its calls in the one public shape of a
recorded call (`openforgerl.store.public_calls`, as the gateway's admin API gives them, without the
token ids: `/api/tokens` has those).

Images: a recorded message names its images by digest (the hex sha256 of their bytes, kept once
each in the store's `images` table). `/api/rollout` gives each message's `images` as
`{"digest", "url", "stored", "media_type", "width", "height", "size"}` (no bytes) and each call's
`image_digests` (its full prompt's, in order); `/api/images/DIGEST?run=` serves the bytes with their
media type and immutable caching (the name is the content): 400 for a malformed digest, 404 for
one the run's store lacks. The page shows lazy thumbnails that open at full size.
"""

from openforgerl.ui.app import ViewerConfig, build_app, is_loopback, serve

__all__ = ["ViewerConfig", "build_app", "is_loopback", "serve"]
