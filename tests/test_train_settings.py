"""`openforge train`'s settings, declared once in rl/config.py: every one is an option, an option
given lands in run.json at its path, and an old run.json still resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from openforgerl.cli.train import train_cmd
from openforgerl.rl import loop
from openforgerl.rl.config import NOT_SET, LossConfig, TrainerConfig, TrainOptions, Tuning
from openforgerl.settings import settings_of


def _train(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[TrainOptions]]:
    """`openforge train ARGS` with the training itself replaced: the options it would train with."""
    seen: list[TrainOptions] = []

    def fake_train(opts: TrainOptions, *, resume: bool = False) -> dict[str, Any]:
        seen.append(opts)
        return {"steps": opts.steps, "policy_version": 0, "checkpoint": "-", "metrics": "-"}

    monkeypatch.setattr(loop, "train", fake_train)
    return CliRunner().invoke(train_cmd, args), seen


def _fields(cls: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        inner = {c.__name__: c for c in (TrainerConfig, LossConfig, Tuning)}.get(str(f.type))
        out |= _fields(inner, f"{prefix}{f.name}.") if inner else {prefix + f.name}
    return out


def test_every_training_setting_is_an_option_of_train() -> None:
    """A field added to TrainOptions, TrainerConfig, LossConfig or Tuning is an option at once; the
    only settings without one are named in NOT_SET, each with why."""
    params = {p.name for p in train_cmd.params}
    settings = _fields(TrainOptions) - {"backend"}
    missing = {key for key in settings if key.replace(".", "__") not in params}
    assert missing == {"model"}  # --model (model_dir): not needed with --resume
    assert set(NOT_SET) == {"model", "out", "backend", "trainer.temperature", "trainer.seed"}
    assert not {"temperature", "seed"} & {f.name for f in dataclasses.fields(TrainerConfig)}  # the run's
    options = [o for p in train_cmd.params for o in p.opts]
    assert len(options) == len(set(options))


def test_options_land_in_run_json_at_their_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--model", "m", "--out", str(tmp_path / "r"), "--temperature", "0.9", "--seed", "3"]
    args += ["--clip-ratio-c", "2.5", "--betas", "0.9", "0.95", "--no-measure-update"]
    args += ["--keep-zero-variance", "--max-context", "4096", "--tis", "none", "--lora-rank", "4"]
    args += ["--loss-agg-mode", "seq-mean-token-mean", "--kl-type", "mse", "--eval-split", "test"]
    result, (opts,) = _train(args, monkeypatch)
    assert result.exit_code == 0, result.output
    saved = opts.to_json()
    assert saved["temperature"] == 0.9 and saved["seed"] == 3
    assert saved["trainer"]["loss"] == {
        **dataclasses.asdict(LossConfig()),
        "clip_ratio_c": 2.5,
        "tis": None,
        "loss_agg_mode": "seq-mean-token-mean",
        "kl_type": "mse",
    }
    assert opts.trainer.betas == (0.9, 0.95) and opts.trainer.measure_update is False
    assert opts.trainer.drop_zero_variance is False and opts.trainer.tuning.lora_rank == 4
    assert opts.max_context == 4096 and opts.eval_split == "test"
    # Not given: the config's defaults, declared there alone.
    assert opts.concurrency == TrainOptions.concurrency and opts.trainer.lr == TrainerConfig.lr
    result, (again,) = _train([*args[:4], "--max-context", "none"], monkeypatch)
    assert result.exit_code == 0 and again.max_context is None


def test_an_old_run_json_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json written when the trainer held a temperature and a seed of its own: read, each once."""
    run = tmp_path / "r"
    old = TrainOptions(model="m", out=run, temperature=0.7, seed=5).to_json()
    old["trainer"] |= {"temperature": 0.7, "seed": 5}
    run.mkdir()
    (run / loop.RUN_FILE).write_text(json.dumps(old))
    result, (opts,) = _train(["--out", str(run), "--resume", "--lr", "1e-3"], monkeypatch)
    assert result.exit_code == 0, result.output
    assert opts.temperature == 0.7 and opts.seed == 5 and opts.trainer.lr == 1e-3
    assert "resumed with trainer.lr = 0.001 (was 1e-05)" in result.output
    assert not {"temperature", "seed"} & set(opts.to_json()["trainer"])
    # A trainer seed set apart (--set trainer.seed once could) gives way to the run's, said.
    (run / loop.RUN_FILE).write_text(json.dumps({**old, "trainer": {**old["trainer"], "seed": 1}}))
    with pytest.warns(UserWarning, match="trainer.seed 1 is not the run's seed 5"):
        result, (opts,) = _train(["--out", str(run), "--resume"], monkeypatch)
    assert result.exit_code == 0 and opts.seed == 5


def test_each_setting_is_declared_once_with_its_help() -> None:
    """The options' defaults and help come from the config's fields: none without help."""
    for s in settings_of(TrainOptions, skip=NOT_SET):
        assert s.meta("help"), f"{s.key} has no help"
    by_param = {p.name: p for p in train_cmd.params}
    assert "[default: 8]" in (by_param["concurrency"].help or "")
    assert "[default: 1.0]" in (by_param["temperature"].help or "")
