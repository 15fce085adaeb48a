"""`openforge train`'s settings, declared once in rl/config.py: every one is an option, an option
given lands in run.json at its path, and an old run.json still resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
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


def test_an_option_whose_default_the_command_computes_shows_that_default() -> None:
    """eval's run folder defaults to runs/eval-TASKS-HARNESS, made from the options given: its help
    says so, not the field's placeholder."""
    from openforgerl.cli.eval import eval_cmd

    out = next(p for p in eval_cmd.params if p.name == "out")
    help_text = out.help or ""
    assert help_text.endswith("[default: runs/eval-TASKS-HARNESS]") and "runs/eval]" not in help_text


def test_train_temperature_is_one_setting_on_the_command_line_and_in_run_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    base = ["--out", str(run)]
    result, (opts,) = _train([*base, "--model", "m", "--temperature", "0.7", "--lr", "1e-3"], monkeypatch)
    assert result.exit_code == 0, result.output
    assert opts.temperature == 0.7 and opts.trainer.lr == 1e-3
    assert opts.trainer.neg_adv_scale == 1.0
    result, (scaled,) = _train([*base, "--model", "m", "--neg-adv-scale", "0.25"], monkeypatch)
    assert result.exit_code == 0 and scaled.trainer.neg_adv_scale == 0.25
    assert scaled.to_json()["trainer"]["neg_adv_scale"] == 0.25
    result, (cur,) = _train([*base, "--model", "m", "--curriculum", "--headroom-tasks", "32"], monkeypatch)
    assert result.exit_code == 0 and cur.curriculum and cur.headroom_tasks == 32
    saved = opts.to_json()
    assert saved["temperature"] == 0.7 and "temperature" not in saved["trainer"]  # one place in run.json
    run.mkdir()
    (run / loop.RUN_FILE).write_text(json.dumps(saved))

    # --resume: run.json's settings; an option given again changes one, on both sides, and is said.
    result, (resumed,) = _train([*base, "--resume"], monkeypatch)
    assert result.exit_code == 0 and resumed.temperature == 0.7 and resumed.trainer.lr == 1e-3
    result, (resumed,) = _train([*base, "--resume", "--temperature", "0.9"], monkeypatch)
    assert result.exit_code == 0, result.output
    assert resumed.temperature == 0.9
    assert "resumed with temperature = 0.9 (was 0.7)" in result.output
    assert resumed.trainer.lr == 1e-3 and resumed.model == "m"  # the rest is the run's

    # A run.json whose trainer names another temperature than the rollouts' is refused, plainly.
    (run / loop.RUN_FILE).write_text(
        json.dumps({**saved, "trainer": {**saved["trainer"], "temperature": 1.0}})
    )
    result, seen = _train([*base, "--resume"], monkeypatch)
    assert result.exit_code != 0 and not seen
    assert "trainer.temperature 1 is not the run's temperature 0.7" in result.output
    # One that repeats the run's (as run.json did before it was left out) is the same run.
    (run / loop.RUN_FILE).write_text(
        json.dumps({**saved, "trainer": {**saved["trainer"], "temperature": 0.7}})
    )
    result, (resumed,) = _train([*base, "--resume", "--temperature", "0.8"], monkeypatch)
    assert result.exit_code == 0 and resumed.temperature == 0.8
    assert "temperature" not in resumed.to_json()["trainer"]  # migrated: the run's alone


def test_train_set_reaches_every_setting_of_run_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openforgerl.rl.config import setting_keys

    keys = setting_keys()
    assert "trainer.temperature" not in keys and "model" not in keys
    assert {"split", "max_context", "on_failure", "keep_checkpoints", "trainer.weight_decay"} <= set(keys)
    assert {
        "trainer.betas",
        "trainer.loss.loss_agg_mode",
        "trainer.loss.kl_type",
        "trainer.tuning.lora_rank",
    } <= set(keys)
    sets = [
        "trainer.weight_decay=0.01",
        "trainer.betas=[0.9, 0.95]",
        "trainer.measure_update=false",
        "trainer.loss.loss_agg_mode=seq-mean-token-mean",
        "trainer.loss.tis=none",
        "max_context=none",
        "eval_split=test",
        "keep_checkpoints=3",
    ]
    args = ["--model", "m", "--out", str(tmp_path / "r")]
    result, (opts,) = _train([*args, *(x for s in sets for x in ("--set", s))], monkeypatch)
    assert result.exit_code == 0, result.output
    assert opts.trainer.weight_decay == 0.01 and opts.trainer.betas == (0.9, 0.95)
    assert opts.trainer.measure_update is False and opts.trainer.loss.tis is None
    assert opts.trainer.loss.loss_agg_mode == "seq-mean-token-mean"
    assert opts.max_context is None and opts.eval_split == "test" and opts.keep_checkpoints == 3
    for bad, said in [
        ("trainer.temperature=0.5", "--temperature"),
        ("nope=1", "no setting of a run"),
        ("trainer.lr=fast", "trainer.lr=fast: not float"),
        ("trainer.loss.loss_agg_mode=mean", "loss_agg_mode must be one of"),
        ("model=x", "--model"),
    ]:
        result, seen = _train([*args, "--set", bad], monkeypatch)
        assert result.exit_code != 0 and said in result.output and not seen, (bad, result.output)


def test_every_sft_setting_is_an_option_of_sft_and_reaches_its_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`openforge sft`'s training options are SFTConfig's settings (Tuning's walked into): a field
    added there is an option at once, with the field's default, and a given option reaches the
    SFTTrainer's config while the rest keep their defaults."""
    from openforgerl.cli.sft import sft_cmd
    from openforgerl.rl import sft
    from openforgerl.rl.config import SFTConfig

    params = {p.name for p in sft_cmd.params}
    assert {s.param for s in settings_of(SFTConfig)} <= params
    seen: list[SFTConfig] = []

    class Stop(Exception):
        pass

    def fake_trainer(model_dir: str, cfg: SFTConfig, **kw: Any) -> None:
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(sft, "SFTTrainer", fake_trainer)
    monkeypatch.setattr(sft, "load_sft_data", lambda data, model: SimpleNamespace(image_source=None))
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    args = ["--data", str(data), "--model", "m", "--out", str(tmp_path / "o"), "--lr", "3e-4"]
    args += ["--schedule", "cosine", "--lora-rank", "4", "--gradient-checkpointing", "--device", "cpu"]
    result = CliRunner().invoke(sft_cmd, args)
    assert isinstance(result.exception, Stop), result.output
    (cfg,) = seen
    assert (cfg.lr, cfg.schedule, cfg.device) == (3e-4, "cosine", "cpu")
    assert cfg.tuning == Tuning(lora_rank=4, gradient_checkpointing=True)
    assert (cfg.epochs, cfg.batch_size, cfg.micro_batch_tokens) == (3, 16, 0)  # SFTConfig's defaults
    assert CliRunner().invoke(sft_cmd, [*args[:6], "--lr", "0"]).exit_code == 2  # a rate above 0


def test_every_eval_setting_is_an_option_of_eval_and_rollout_and_reaches_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`openforge eval` and `rollout` take EvalOptions' settings as options (rollout less --k): a
    field added there is an option at once; given ones reach the run, the rest keep their defaults."""
    from openforgerl import evaluate
    from openforgerl.cli.eval import eval_cmd
    from openforgerl.cli.rollout import rollout_cmd
    from openforgerl.eval_options import NOT_OPTIONS, EvalOptions

    settings = {s.param for s in settings_of(EvalOptions, NOT_OPTIONS)}
    assert settings <= {p.name for p in eval_cmd.params}
    rollout_params = {p.name for p in rollout_cmd.params}
    assert settings - {"k"} <= rollout_params and "k" not in rollout_params
    seen: list[EvalOptions] = []

    class Stop(Exception):
        pass

    def fake(opts: EvalOptions, *names: Any) -> None:
        seen.append(opts)
        raise Stop

    monkeypatch.setattr(evaluate, "run_eval", fake)
    monkeypatch.setattr(evaluate, "run_and_write_trajectories", fake)
    args = ["--tasks", "tools-tiny", "--model", "m", "--temperature", "0.5", "--seed", "7"]
    args += [
        "--max-steps",
        "40",
        "--no-progress",
        "--network",
        "host",
        "--on-failure",
        "drop",
        "--engine",
        "vllm",
    ]
    result = CliRunner().invoke(eval_cmd, [*args, "--k", "2", "--n", "4", "--out", str(tmp_path / "e")])
    assert isinstance(result.exception, Stop), result.output
    opts = seen[-1]
    assert (opts.temperature, opts.seed, opts.max_steps, opts.progress) == (0.5, 7, 40, False)
    assert (opts.network, opts.on_failure, opts.k, opts.n, opts.model) == ("host", "drop", 2, 4, "m")
    assert opts.out == tmp_path / "e" and opts.harness == "react" and opts.engine == "vllm"
    assert opts.max_tokens == EvalOptions.max_tokens and opts.concurrency == EvalOptions.concurrency
    result = CliRunner().invoke(rollout_cmd, [*args, "--harness", "pi"])
    assert isinstance(result.exception, Stop), result.output
    assert seen[-1].out == Path("runs/rollout-tools-tiny-pi") and (seen[-1].k, seen[-1].n) == (1, None)
    for command, bad in ((eval_cmd, ["--k", "3", "--n", "2"]), (rollout_cmd, ["--k", "2"])):
        result = CliRunner().invoke(command, ["--tasks", "tools-tiny", "--model", "m", *bad])
        assert result.exit_code == 2 and len(seen) == 2, (bad, result.output)


def test_every_gateway_setting_is_an_option_of_gateway_and_reaches_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from openforgerl.cli.gateway import gateway
    from openforgerl.gateway import server
    from openforgerl.gateway.config import GatewayConfig

    assert {s.param for s in settings_of(GatewayConfig, ("upstreams",))} <= {p.name for p in gateway.params}
    seen: list[GatewayConfig] = []
    monkeypatch.setattr(server, "serve", seen.append)
    args = ["--model", "m", "--port", "0", "--temperature", "none", "--header-timeout-s", "5"]
    args += ["--durability", "normal", "--upstream", "judge=openai:gpt-x"]
    result = CliRunner().invoke(gateway, args, env={"OPENFORGE_ADMIN_TOKEN": "t0k"})
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.model, cfg.port, cfg.temperature, cfg.header_timeout_s) == ("m", 0, None, 5.0)
    assert cfg.durability == "normal" and cfg.admin_token == "t0k" and cfg.upstreams[0].name == "judge"
    assert cfg.max_tokens == GatewayConfig.max_tokens and cfg.body_timeout_s == GatewayConfig.body_timeout_s
    for bad in (["--port", "0"], ["--model", "m", "--top-p", "2"], ["--model", "m", "--durability", "x"]):
        assert CliRunner().invoke(gateway, bad).exit_code == 2 and len(seen) == 1
