"""The README's examples run as written: its admin `curl` commands against a started gateway."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from openforgerl.gateway.config import UpstreamSpec
from tests.gateway_helpers import ScriptEngine, running_gateway

README = Path(__file__).resolve().parent.parent / "README.md"
# A `curl` command in a ```bash block, with its `\`-continued lines.
CURL = re.compile(r"^curl (?:.*\\\n)*.*$", re.MULTILINE)
# What the examples assume: the gateway on port 8000 with admin token `secret` and a `claude` upstream.
README_GATEWAY = "localhost:8000"


def readme_curls() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    return [m.group(0) for block in blocks for m in CURL.finditer(block)]


def test_the_readme_has_admin_curl_examples() -> None:
    curls = readme_curls()
    assert len(curls) >= 2 and all("/admin/rollouts" in c for c in curls), curls


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_readmes_curl_examples_run_as_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by a probe: after the admin API took JSON only, the examples' bare `-d` (a form body to
    curl) got a 415. Each runs with only the gateway's address swapped in."""
    teacher = UpstreamSpec("claude", "anthropic", "claude-sonnet-4-5")  # named, never called
    with running_gateway(
        tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir), admin_token="secret", upstreams=[teacher]
    ) as gw:
        address = gw.url.removeprefix("http://")
        for example in readme_curls():
            argv = [a.replace(README_GATEWAY, address) for a in shlex.split(example.replace("\\\n", " "))]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, (example, done.stderr)
            answer = json.loads(done.stdout)
            assert answer["api_key"].startswith("ofk-") and answer["rollout_id"], (example, answer)
