"""Run one function of a benchmark module in a new interpreter: OpenMP settings are read when torch
loads and peak memory is per process, so each measurement gets its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def in_fresh_process(module: str, fn: str, *args: Any, env: dict[str, str] | None = None, **kw: Any) -> Any:
    """`module.fn(*args, **kw)` (a module beside this file) in a new interpreter; its JSON result."""
    code = (
        f"import json, sys; sys.path.insert(0, sys.argv[1]); import {module} as b; "
        f"a, k = json.loads(sys.argv[2]); print('RESULT ' + json.dumps(b.{fn}(*a, **k)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), json.dumps([args, kw])],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{module}.{fn}{args}{kw} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
