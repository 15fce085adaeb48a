"""The built-in ReAct harness against the gateway, driven by a scripted policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway


def call(name: str, **arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


STEPS = [
    call("read_file", path="a.txt"),
    call("bash", command="echo $(( $(cat a.txt) + 5 )) > answer.txt"),
    call("read_file", path="../outside.txt"),
    call("submit", answer="done"),
]


def test_react_agent_runs_tools_and_submits(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = ScriptEngine(tiny_model_dir)
    engine.script = lambda prompt: STEPS[engine.tokenizer.decode(prompt).count("<tool_response>")]
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("37\n")
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        ro = new_rollout(gw)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "openforgerl.react_agent",
                "--base-url",
                ro["base_url"],
                "--api-key",
                ro["api_key"],
                "--task",
                "Add 5 to the number in a.txt and write it to answer.txt.",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=work,
            check=False,
        )
        calls = calls_of(gw, ro["rollout_id"])
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["stopped"] == "submitted" and outcome["answer"] == "done"
    assert outcome["tool_calls"] == 4 and outcome["tool_errors"] == 1  # the path outside the workspace
    assert (work / "answer.txt").read_text().strip() == "42"
    assert len(calls) == 4 and {c["branch_id"] for c in calls} == {0}
    assert all(c["branch_reason"] == "" for c in calls[1:])
