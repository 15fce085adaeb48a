"""`openforge eval`: pass@k, pass^k and mean reward of tasks run n times; the harness study."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import eval_options, refusing_bad_network, rollout_options
from openforgerl.eval_options import EvalOptions
from openforgerl.run.folder import RunFolder


@click.command("eval")
@rollout_options()
def eval_cmd(**kw: Any) -> None:
    """Run tasks n times each; report pass@k, pass^k and mean reward with 95% confidence intervals."""
    from openforgerl.evaluate import run_eval

    names = kw["harness"] or [EvalOptions.harness]
    opts = eval_options(kw, f"runs/eval-{kw['tasks']}-{'-'.join(names)}")
    if opts.n is not None and opts.n < opts.k:
        raise click.BadParameter(f"--n ({opts.n}) must be at least --k ({opts.k})", param_hint="--n")
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
