"""`python -m openforgerl.demo`: the demo's command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from openforgerl.demo import pipeline
from openforgerl.demo.config import QUICK, DemoConfig
from openforgerl.run.folder import RunFolder


def viewer_line(out: Path) -> str:
    """The command that opens the run's story in the viewer: its phases, each evaluation, and the
    before/after comparisons."""
    return (
        f"the whole run, phase by phase, and the before/after comparisons: "
        f"openforge view --runs {out} --model {out / 'model'}  (then http://127.0.0.1:8600/#/run/{out.name})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m openforgerl.demo",
        description=pipeline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    ap.add_argument("--quick", action="store_true", help="toy sizes: proves the pipeline in a few minutes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--harness", default="react", help="react (built in) or an agent CLI, e.g. mini-swe-agent, pi"
    )
    ap.add_argument(
        "--until",
        choices=["sft"],
        default=None,
        help="stop after the SFT model's evaluations (a rerun continues)",
    )
    args = ap.parse_args(argv)
    cfg = DemoConfig(
        out=args.out, seed=args.seed, harness=args.harness, progress=not args.no_progress, until=args.until
    )
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)  # type: ignore[arg-type]
    report = pipeline.run(cfg)
    if cfg.until:
        print(
            f"stopped after {cfg.until}: {', '.join(report['evaluations'])} evaluated; "
            "rerun without --until to go on"
        )
        return
    out = RunFolder(cfg.out)
    print(out.report_md.read_text())
    print(f"report: {out.report_md}; curve: {out.reward_curve}")
    print(viewer_line(cfg.out))
    if not report["evaluations"]:
        sys.exit(1)
