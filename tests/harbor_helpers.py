"""Harbor task folders written by the tests (task.toml, instruction, tests/test.sh, a solution, an
environment with its files or Dockerfile): the task sets of tasks/test_harbor.py and the Docker
backend's tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

TOML = """\
version = "1.0"

[metadata]
difficulty = "easy"
tags = ["t"]
{metadata}

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 30.0
{verifier}

[environment]
{environment}
"""


def harbor_task(
    root: Path,
    name: str,
    *,
    test_sh: str,
    solve_sh: str | None,
    instruction: str | None = None,
    environment: str = "",
    metadata: str = "",
    verifier: str = "",
    workspace: dict[str, bytes] | None = None,
    dockerfile: str | None = None,
) -> Path:
    folder = root / name
    (folder / "tests").mkdir(parents=True)
    (folder / "task.toml").write_text(
        TOML.format(metadata=metadata, verifier=verifier, environment=environment)
    )
    (folder / "instruction.md").write_text(instruction or f"Solve {name} in /app.\n")
    (folder / "tests" / "test.sh").write_text(textwrap.dedent(test_sh))
    if solve_sh is not None:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text(textwrap.dedent(solve_sh))
    if workspace or dockerfile:
        (folder / "environment").mkdir()
    for rel, data in (workspace or {}).items():
        (folder / "environment" / rel).write_bytes(data)
    if dockerfile is not None:
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
    return folder


REWARD_TXT = """\
    #!/bin/bash
    if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
SOLVE_42 = "#!/bin/bash\necho 42 > /app/answer.txt\n"
