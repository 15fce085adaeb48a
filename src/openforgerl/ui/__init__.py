"""`openforge view`: a read-only trace viewer and run dashboard in the browser.

A Starlette app (`app.py`) serves a JSON API under /api and a front end of plain ES modules
(`static/`, no build step; uPlot vendored from its npm tarball, see static/vendor/README.md).
Read-only, and through the store's API only (the viewer holds no SQL): a store is read with
`openforgerl.store.view.StoreView`, a runner's runner.db with `openforgerl.store.run_state`, both
opened with SQLite `mode=ro` URIs; `--create-indexes` is the one opt-in write (the store's
`VIEWER_INDEXES`). Loopback by default; a token is required on any other address.

What the viewer reads (the contract with the runner and the trainer):

- `--store PATH`: a gateway store (`openforgerl.store`). Each distinct `rollouts.run_id` is a run.
- `--runs DIR`: run folders: DIR itself and every folder below it (up to four levels, through
  folders that are not runs, such as the demo's `eval/`) that holds any of the files below, except
  a model's folder (weights and tokenizer) and a run's `checkpoints/`, `steps/`, `evals/`,
  `tensorboard/`. A run folder below another is a phase of it: `/api/runs` lists the runs, each with
  its `phases` (those its status.json records, in order, then the others found below it). A
  folder's name is the run_id its rollouts carry in `--store`, unless the folder has its own
  `gateway.db` (as `openforge eval` writes), which is then read; a store of several run_ids that
  are not the folder's name (a trainer's `rl-step1`, `rl-step2`, ...) holds the steps of that one
  run: `RUN#RUN_ID` names a step's rollouts.
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
- `<run>/status.json` (`openforgerl.run_status`, written by the demo, `openforge eval`, `openforge
  train` and the harness study): `{"state": "running" | "finished" | "failed" | "interrupted",
  "pid", "host", "started_at", "finished_at", "error", "phases": {NAME: {"state", "folder", ...}}}`.
  A "running" whose pid is gone on this host is shown interrupted ("done" reads as finished). A
  folder without one takes its state from its entry in its parent's `phases`, else finished when it
  has a report.json, running when its runner.db has rollouts pending or running or its store has
  open ones, finished when its runner.db is complete, else unknown: never from file times. Runs that
  are not finished, failed or interrupted are polled.
- `<run>/report.json` (`openforge eval`): the evaluation page (intervals, per tag, per task,
  failures, behaviour). Evaluations of the same tasks (eval_key: task ids, runs per task,
  temperature) among a run's phases are offered as comparisons, `/api/compare?runs=A&runs=B...`:
  each pair's paired difference (`eval_stats.paired_difference`, its defaults: report.json's).
- `<run>/eval-*/report.json`, `<run>/eval/*/report.json` and `<run>/evals.jsonl`:
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
`/api/info`, `/api/runs`, `/api/run?run=`, `/api/compare?runs=&runs=`, `/api/metrics?run=&after=STEP`,
`/api/rollouts?run=&page=&page_size=&sort=[-]KEY&status=&task=&dialect=&failure=&min_reward=&max_reward=`,
`/api/rollout?run=&id=`, `/api/tokens?run=&id=`, `/api/images/DIGEST?run=`. The front end polls a run
that is not finished every few seconds.

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
