"""The embedded trainer: any Hugging Face causal LM, on the CPU or one GPU, trained on recorded samples.

One training step takes the rollouts of a batch of tasks (G per task: a group), drops groups whose
rewards are all equal (they carry no signal for group-relative estimators) and counts them, gives
every kept rollout an advantage with veRL's estimator, and runs `ppo_epochs` passes of
`mini_batches` AdamW updates over its samples, each accumulated over micro-batches that fit a token
budget, with gradient clipping (the rate warmed up linearly over the first `warmup_steps` updates).
Losses and importance weights come from veRL (`openforgerl.rl.algos`).

Besides veRL's metrics, a step reports the policy's entropy on the trained tokens (from the same
forward pass), the rollout policy's (`sampled_nll`, from the engine's logprobs of every scored
rollout), the PPO ratio when there is more than one update, and with `measure_update`, how the
update moved the trained rollouts' log-likelihood (`update/...`: up for positive advantages, down
for negative ones, re-scored with the new weights; a sample of each sign on a large step).

Current logprobs are recomputed by the policy under training (`rl/policy.py` Policy: model,
tokenizer, optimizer, micro-batches, LoRA, vision inputs) at the run's sampling temperature. The
behaviour logprobs recorded by the gateway are the rollout policy; pi_old is the trainer's policy
at the start of the step (with one update per step it equals the current policy, so it is taken
from the same forward pass, detached). Only with more than one update does the PPO clip act: it
bounds how far the later updates move from pi_old.

After a step, `save` writes an HF checkpoint (model, tokenizer, optimizer, trainer state) and
`push_weights` loads it into the engine in place, which bumps the policy version the gateway
records on every later call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openforgerl import vision
from openforgerl.engines.base import Engine
from openforgerl.rl import algos
from openforgerl.rl.config import TrainerConfig as TrainerConfig
from openforgerl.rl.config import Tuning as Tuning
from openforgerl.rl.policy import ADAPTER_DIR as ADAPTER_DIR
from openforgerl.rl.policy import OPTIMIZER_FILE as OPTIMIZER_FILE
from openforgerl.rl.policy import SCHEDULER_FILE as SCHEDULER_FILE
from openforgerl.rl.policy import SHARED_PREFIX_MIN as SHARED_PREFIX_MIN
from openforgerl.rl.policy import STATE_FILE as STATE_FILE
from openforgerl.rl.policy import Collated
from openforgerl.rl.policy import ImageSource as ImageSource
from openforgerl.rl.policy import Policy as Policy
from openforgerl.rl.policy import common_prefix as common_prefix
from openforgerl.rl.policy import micro_batches as micro_batches
from openforgerl.rollouts.trajectory import Sample


@dataclass
class Rollout:
    """One rollout's samples and reward (None: not scored); `group` is its task."""

    group: str
    reward: float | None
    samples: list[Sample]


def passed(reward: float) -> bool:
    return reward >= 1.0 - 1e-9


def select_groups(
    rollouts: Sequence[Rollout], drop_zero_variance: bool = True
) -> tuple[list[Rollout], dict[str, Any]]:
    """The rollouts worth training on, and counts of what was left out and why."""
    by_group: dict[str, list[Rollout]] = defaultdict(list)
    unscored = 0
    for r in rollouts:
        if r.reward is None:
            unscored += 1
        else:
            by_group[r.group].append(r)
    kept: list[Rollout] = []
    zero_variance = single = 0
    for members in by_group.values():
        if len(members) < 2:
            single += 1  # no group baseline without a second rollout
        elif drop_zero_variance and len({m.reward for m in members}) == 1:
            zero_variance += 1
        else:
            kept.extend(members)
    scored = [r.reward for r in rollouts if r.reward is not None]
    stats = {
        "rollouts": len(rollouts),
        "rollouts_unscored": unscored,
        "groups": len(by_group),
        "groups_kept": len(by_group) - zero_variance - single,
        "groups_dropped_zero_variance": zero_variance,
        "groups_dropped_single": single,
        "reward_mean": sum(scored) / len(scored) if scored else 0.0,
        "pass_rate": sum(passed(x) for x in scored) / len(scored) if scored else 0.0,
    }
    return kept, stats


def scale_negative(advantages: Sequence[float], scale: float) -> list[float]:
    """The advantages with every negative one multiplied by `scale` (TrainerConfig.neg_adv_scale)."""
    return [a * scale if a < 0 else a for a in advantages]


def sampled_nll(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """`sampled_nll`: the mean negative behaviour logprob (the engine's) per loss token over every
    scored rollout, trained or not: an estimate of the rollout policy's entropy. Empty without tokens."""
    total = tokens = 0.0
    for r in rollouts:
        if r.reward is None:
            continue
        for s in r.samples:
            for m, lp in zip(s.loss_mask, s.logprobs, strict=False):
                if m:
                    total -= lp
                    tokens += 1
    return {"sampled_nll": total / tokens} if tokens else {}


def _ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean (over loss tokens), max and min of the PPO ratio pi / pi_old."""
    on = mask > 0
    if not bool(on.any()):
        return {}
    ratio = log_ratio[on].exp()
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
    }


class _Metrics:
    """Micro-batch metrics folded into one step: sums, extremes, or means weighted by loss tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.extremes: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            if not math.isfinite(v):
                continue
            if k.endswith("_max"):
                self.extremes[k] = max(v, self.extremes.get(k, v))
            elif k.endswith("_min"):
                self.extremes[k] = min(v, self.extremes.get(k, v))
            elif k == "loss" or k.endswith("_loss"):  # each micro-batch holds its share of the mini-batch's
                self.sums[k] += v
            else:
                self.sums[k] += v * weight
                self.weights[k] += weight

    def result(self, updates: int) -> dict[str, float]:
        out = dict(self.extremes)
        for k, v in self.sums.items():
            out[k] = v / self.weights[k] if k in self.weights else v / max(updates, 1)
        return out


class Trainer:
    """RL on groups of rollouts. `step` counts training steps taken (with or without an update),
    `policy_version` the updates: the version of the weights the trainer holds."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        *,
        group_size: int,
        temperature: float = 1.0,
        seed: int = 0,
        reference_dir: str | Path | None = None,
        image_source: ImageSource | None = None,
        demonstrations: Sequence[Sample] = (),
        adapter_dir: str | Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.seed = seed  # the run's (TrainOptions.seed), as `temperature` is the run's sampling one
        self.demonstrations = [s for s in demonstrations if s.num_loss_tokens]
        if cfg.ptx_coef > 0 and not self.demonstrations:
            raise ValueError("ptx_coef > 0 needs demonstrations (SFT samples) to take the SFT loss on")
        self.policy = Policy(
            model_dir,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
            temperature=temperature,
            device=cfg.device,
            seed=seed,
            image_source=image_source,
            tuning=cfg.tuning,
            adapter_dir=adapter_dir,
            warmup_steps=cfg.warmup_steps,
            precision=cfg.precision,
        )
        self.actor_config = algos.actor_config(cfg.loss, group_size)
        self.reference: Any = None
        if cfg.loss.kl_coef > 0:
            self.reference = vision.load_model(reference_dir or model_dir)
            self.reference.to(self.policy.device).eval().requires_grad_(False)
        self.step = 0
        self.policy_version = 0

    @classmethod
    def resume(
        cls,
        checkpoint: Path,
        cfg: TrainerConfig,
        *,
        group_size: int,
        reference_dir: str | Path,
        temperature: float = 1.0,
        seed: int = 0,
        image_source: ImageSource | None = None,
        demonstrations: Sequence[Sample] = (),
    ) -> Trainer:
        """The trainer as `save` left it: weights, optimizer, step and policy version. A LoRA run
        continues its saved adapter on the frozen base, `reference_dir` (the run's starting model)."""
        adapter = checkpoint / ADAPTER_DIR
        lora = cfg.tuning.lora and adapter.is_dir()
        trainer = cls(
            reference_dir if lora else checkpoint,
            cfg,
            adapter_dir=adapter if lora else None,
            group_size=group_size,
            temperature=temperature,
            seed=seed,
            reference_dir=reference_dir,
            image_source=image_source,
            demonstrations=demonstrations,
        )
        trainer.policy.load_optimizer(checkpoint)
        state = json.loads((checkpoint / STATE_FILE).read_text())
        trainer.step, trainer.policy_version = int(state["step"]), int(state["policy_version"])
        return trainer

    def train_step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One step on a batch of groups; returns its metrics (`updated` False when nothing was left
        to train on, in which case the weights did not change)."""
        t0 = time.monotonic()
        kept, metrics = select_groups(rollouts, self.cfg.drop_zero_variance)
        advantages = algos.outcome_advantages(
            [float(r.reward or 0.0) for r in kept],
            [r.group for r in kept],
            self.cfg.estimator,
            norm_adv_by_std=self.cfg.norm_adv_by_std,
        )
        if self.cfg.neg_adv_scale != 1.0:
            advantages = scale_negative(advantages, self.cfg.neg_adv_scale)
        samples: list[Sample] = []
        for r, adv in zip(kept, advantages, strict=True):
            for s in r.samples:
                s.advantage = adv
                if s.num_loss_tokens:
                    samples.append(s)
        versions = [v for s in samples if (v := s.min_policy_version) is not None]
        metrics.update(
            samples=len(samples),
            advantage_abs_mean=sum(abs(a) for a in advantages) / len(advantages) if advantages else 0.0,
            staleness_max=self.policy_version - min(versions) if versions else 0,
            groups_zero_variance_fraction=metrics["groups_dropped_zero_variance"] / max(metrics["groups"], 1),
        )
        metrics.update(sampled_nll(rollouts))
        metrics["time/prepare"] = time.monotonic() - t0
        self.step += 1
        metrics["updated"] = bool(samples)
        if samples:
            out, before = self._update(samples)
            metrics.update(out)
            self.policy_version += 1
            if self.cfg.measure_update:
                t1 = time.monotonic()
                metrics.update(self._update_effect(kept, advantages, before))
                metrics["time/measure_update"] = time.monotonic() - t1
        metrics["policy_version"] = self.policy_version
        return metrics

    @torch.no_grad()
    def sequence_logprobs(self, samples: Sequence[Sample]) -> list[float]:
        """Per sample, the summed logprobs of its loss tokens under the current weights, at the
        trainer's temperature (micro-batched like training)."""
        out = [0.0] * len(samples)
        for chunk in self.policy.micro_batches(samples, self.cfg.micro_batch_tokens):
            batch = self.policy.collate([samples[i] for i in chunk])
            sums = (self.policy.logprobs(batch) * batch.mask).sum(-1)
            for row, i in enumerate(chunk):
                out[i] = float(sums[row])
        return out

    def _update_effect(
        self, kept: Sequence[Rollout], advantages: Sequence[float], before: dict[int, float]
    ) -> dict[str, float]:
        """How the step's updates moved the trained rollouts' log-likelihood (summed over their loss
        tokens), over those with an advantage != 0 or a sample of them (`measure_update_rollouts`):
        mean change per rollout and per token for positive and negative advantages, and the fraction
        that moved the way their advantage says."""
        trained = [
            (r, a)
            for r, a in zip(kept, advantages, strict=True)
            if a != 0 and any(s.num_loss_tokens for s in r.samples)
        ]
        trained = self._measured(trained)
        samples = [s for r, _ in trained for s in r.samples if s.num_loss_tokens]
        after = dict(zip(map(id, samples), self.sequence_logprobs(samples), strict=True))
        moves: dict[str, list[tuple[float, int]]] = {"pos": [], "neg": []}
        agree = 0
        for r, adv in trained:
            own = [s for s in r.samples if s.num_loss_tokens]
            change = sum(after[id(s)] - before[id(s)] for s in own)
            moves["pos" if adv > 0 else "neg"].append((change, sum(s.num_loss_tokens for s in own)))
            agree += change * adv > 0
        out: dict[str, float] = {"update/measured_rollouts": len(trained)}
        for sign, rows in moves.items():
            if rows:
                out[f"update/logp_change_{sign}"] = sum(c for c, _ in rows) / len(rows)
                out[f"update/logp_change_{sign}_per_token"] = sum(c for c, _ in rows) / sum(
                    n for _, n in rows
                )
        if trained:
            out["update/direction_agreement"] = agree / len(trained)
        return out

    def _step_rng(self, stream: int) -> random.Random:
        """A generator for this seed and step; each use draws its own `stream`, so that adding one
        (or drawing more from it) leaves the others' draws, and so the run's figures, unchanged."""
        return random.Random(self.seed * 100_003 + self.step + stream)

    def _measured(self, trained: list[tuple[Rollout, float]]) -> list[tuple[Rollout, float]]:
        """At most `measure_update_rollouts` of `trained`: as many of each advantage sign as there
        are up to half the budget, the rest of it from the other sign, drawn with the step's seed."""
        budget = self.cfg.measure_update_rollouts
        if not budget or len(trained) <= budget:
            return trained
        rng = self._step_rng(stream=7)
        pos = [t for t in trained if t[1] > 0]
        neg = [t for t in trained if t[1] < 0]
        rng.shuffle(pos)
        rng.shuffle(neg)
        n_pos = min(len(pos), max(budget // 2, budget - len(neg)))
        return pos[:n_pos] + neg[: budget - n_pos]

    def _update(self, samples: list[Sample]) -> tuple[dict[str, float], dict[int, float]]:
        """The step's optimizer updates on `samples`: their metrics, and each sample's summed
        loss-token logprob before them (keyed by id()), for `_update_effect`."""
        cfg = self.cfg
        rng = self._step_rng(stream=0)
        n_mini = max(1, min(cfg.mini_batches, len(samples)))
        minis = []
        for _ in range(max(1, cfg.ppo_epochs)):  # each pass reshuffles the samples into mini-batches
            order = list(range(len(samples)))
            rng.shuffle(order)
            minis += [[samples[i] for i in order[k::n_mini]] for k in range(n_mini)]
        old: dict[int, torch.Tensor] = {}
        before: dict[int, float] = {}
        t0 = time.monotonic()
        if len(minis) > 1:  # later updates need pi_old from before the first one
            old = self._old_logprobs(samples)
            for s in samples:
                mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32, device=old[id(s)].device)
                before[id(s)] = float((old[id(s)] * mask).sum())
        t_old = time.monotonic() - t0
        agg = _Metrics()
        grad_norms, lrs = [], []
        ptx_losses: list[float] = []
        tokens = loss_tokens = padded = 0
        t1 = time.monotonic()
        for mini in minis:
            size = algos.MiniBatchSize(
                tokens=sum(s.num_loss_tokens for s in mini),
                sequences=sum(1 for s in mini if s.num_loss_tokens),
            )
            for chunk in self.policy.micro_batches(mini, cfg.micro_batch_tokens):
                rows = [mini[i] for i in chunk]
                batch = self.policy.collate(rows)
                lp, entropy = self.policy.logprobs_and_entropy(batch)
                weight = float(batch.mask.sum())
                extra = {"entropy": float((entropy * batch.mask).sum()) / max(weight, 1.0)}
                if old:
                    old_lp = self._gather_old(old, rows, batch)
                    extra.update(_ratio_stats(lp.detach() - old_lp, batch.mask))
                else:
                    old_lp = lp.detach()
                    for s, total in zip(rows, (old_lp * batch.mask).sum(-1).tolist(), strict=True):
                        before[id(s)] = total
                is_weights, corr = algos.importance_weights(old_lp, batch.behaviour, batch.mask, cfg.loss)
                ref_lp = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref_lp = self.policy.logprobs(batch, self.reference)
                loss, m = algos.policy_loss(
                    lp,
                    old_lp,
                    batch.advantages,
                    batch.mask,
                    self.actor_config,
                    size,
                    is_weights=is_weights,
                    ref_logprobs=ref_lp,
                )
                loss.backward()
                if ref_lp is not None:
                    m["kl_ref"] = float(((lp.detach() - ref_lp) * batch.mask).sum()) / max(weight, 1.0)
                agg.add({**m, **corr, **extra, "loss": float(loss.detach())}, weight)
                tokens += batch.real_tokens
                padded += batch.ids.numel()
                loss_tokens += int(weight)
            if cfg.ptx_coef > 0:
                ptx_losses.append(self._ptx_backward(rng))
            lrs.append(self.policy.lr)
            grad_norms.append(self.policy.clip_and_step(cfg.max_grad_norm))
        t_train = time.monotonic() - t1
        out = agg.result(len(minis))
        out.update(
            {
                # Short names for the dashboards; veRL's own keys stay beside them.
                "clip_fraction": out.get("actor/pg_clipfrac", 0.0),
                "kl_behaviour": out.get("rollout_corr/kl", 0.0),
                "is_weight_mean": out.get("rollout_corr/rollout_is_mean", 1.0),
                "is_weight_min": out.get("rollout_corr/rollout_is_min", 1.0),
                "is_weight_max": out.get("rollout_corr/rollout_is_max", 1.0),
                "grad_norm": sum(grad_norms) / len(grad_norms),
                "lr": sum(lrs) / len(lrs),  # the mean over the step's updates (warm-up)
                "optimizer_steps": len(minis),
                "tokens": tokens,
                "tokens_padded": padded,
                "loss_tokens": loss_tokens,
                "tokens_per_s": tokens / t_train if t_train else 0.0,
                "time/old_logprobs": t_old,
                "time/train": t_train,
            }
        )
        if ptx_losses:
            out["ptx_loss"] = sum(ptx_losses) / len(ptx_losses)
        return out, before

    def _ptx_backward(self, rng: random.Random) -> float:
        """Accumulate ptx_coef x the SFT loss of `ptx_batch` demonstrations; returns the SFT loss."""
        batch_size = min(self.cfg.ptx_batch, len(self.demonstrations))
        demos = rng.sample(self.demonstrations, batch_size)
        return self.policy.sft_loss(demos, self.cfg.micro_batch_tokens, self.cfg.ptx_coef)[0]

    @torch.no_grad()
    def _old_logprobs(self, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """pi_old per sample (keyed by id()), aligned with input_ids[1:]."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.policy.micro_batches(samples, self.cfg.micro_batch_tokens):
            rows = [samples[i] for i in chunk]
            batch = self.policy.collate(rows)
            lp = self.policy.logprobs(batch)
            for row, s in enumerate(rows):
                full = torch.zeros(len(s.input_ids) - 1, device=lp.device)
                keep = batch.positions < len(s.input_ids) - 1
                full[batch.positions[keep]] = lp[row, keep]
                out[id(s)] = full
        return out

    @staticmethod
    def _gather_old(old: dict[int, torch.Tensor], rows: list[Sample], batch: Collated) -> torch.Tensor:
        out = torch.zeros_like(batch.mask)
        for row, s in enumerate(rows):
            keep = batch.positions < len(s.input_ids) - 1
            out[row, keep] = old[id(s)][batch.positions[keep]]
        return out

    def state(self, **extra: Any) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "config": dataclasses.asdict(self.cfg),
            **extra,
        }

    def save(self, path: Path, **extra: Any) -> None:
        self.policy.save(path, self.state(**extra))

    async def push_weights(self, engine: Engine, checkpoint: Path) -> int:
        """Load `checkpoint` (from `save`) into the engine in place; returns the engine's new version."""
        return await engine.load_weights(str(checkpoint))


def iter_checkpoints(root: Path) -> Iterator[tuple[int, Path]]:
    """(step, path) of every finished checkpoint under `root` (named step-NNNNNN), oldest first."""
    if not root.is_dir():
        return
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE_FILE).is_file():
            found.append((int(p.name[5:]), p))
    yield from sorted(found)


class MetricsLog:
    """metrics.jsonl in the run dir (one JSON object per step, with a `step` key), mirrored to
    TensorBoard when the `tensorboard` package is installed."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: TensorBoard is not a dependency
            pass
        else:
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def steps(self) -> set[int]:
        """Steps already logged (to complete, not repeat, the log after a crash)."""
        if not self.path.is_file():
            return set()
        done = set()
        for line in self.path.read_text().splitlines():
            try:
                done.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        return done

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        with self.path.open("ab+") as f:
            torn = False
            if f.seek(0, 2):
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
            # A line cut short by a crash stays on its own line, so it never spoils this one.
            f.write((b"\n" if torn else b"") + json.dumps({"step": step, **metrics}).encode() + b"\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
