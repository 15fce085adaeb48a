"""What the built-in harnesses (react.py, gui.py) share: their command line and their last line.

Each runs inside the rollout's sandbox as

    python -m openforgerl.harnesses.NAME --base-url URL --api-key KEY --task TEXT|@FILE \\
        [--model NAME] [--max-tokens N] [--workdir DIR] ...its own options

and prints one JSON line at the end: its outcome. The standard library only: a sandbox shows the
harnesses' own modules of this package and nothing else (launch.py's SANDBOX_MODULES).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any


def command_line(description: str | None) -> argparse.ArgumentParser:
    """The options every built-in harness takes; each adds its own."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", required=True, help="the rollout's base URL (without /v1)")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--task", required=True, help="the instruction, or @FILE to read it from a file")
    ap.add_argument("--model", default="policy")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--workdir", default=".")
    return ap


def common_args(a: argparse.Namespace) -> dict[str, Any]:
    """The common options, parsed, as the harness's `run` takes them (the task read from its file)."""
    task = Path(a.task[1:]).read_text() if a.task.startswith("@") else a.task
    return {
        "base_url": a.base_url,
        "api_key": a.api_key,
        "task": task,
        "model": a.model,
        "max_tokens": a.max_tokens,
        "workdir": Path(a.workdir),
    }


def report(outcome: Any) -> None:
    """The harness's last line: its outcome (a dataclass) as JSON."""
    print(json.dumps(asdict(outcome)), flush=True)
