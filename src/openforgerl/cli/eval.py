"""`openforge eval`: pass@k, pass^k and mean reward of tasks run n times; the harness study."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import eval_options, refusing_bad_network, rollout_options
from openforgerl.eval_options import EvalOptions
from openforgerl.run.folder import RunFolder


@click.command("eval")
@rollout_options
@click.option(
    "--k", "k", type=int, default=EvalOptions.k, show_default=True, help="pass@k and pass^k for k = 1..K."
)
@click.option("--n", "n", type=int, default=EvalOptions.n, help="Runs per task (n >= k; default k).")
def eval_cmd(k: int, n: int | None, **kw: Any) -> None:
    """Run tasks n times each; report pass@k, pass^k and mean reward with 95% confidence intervals."""
    from openforgerl.evaluate import run_eval

    if n is not None and n < k:
        raise click.BadParameter(f"--n ({n}) must be at least --k ({k})", param_hint="--n")
    names = kw.pop("harness")
    kw["harness"] = names[0]
    opts = eval_options(kw, k, n, f"runs/eval-{kw['tasks']}-{'-'.join(names)}")
    run = RunFolder(opts.out)
    if len(names) > 1:
        from openforgerl.evaluate import run_study

        study = refusing_bad_network(lambda o: run_study(o, names), opts)
        click.echo(run.study_md.read_text())
        click.echo(f"study: {run.study} and {run.study_md}; each harness in {opts.out}/NAME")
        if not any(r["scored"] for r in study["harnesses"].values()):
            raise SystemExit(1)
        return
    report = refusing_bad_network(run_eval, opts)
    click.echo(run.report_md.read_text())
    click.echo(f"report: {run.report} and {run.report_md}")
    if report["scored"] == 0:
        raise SystemExit(1)
