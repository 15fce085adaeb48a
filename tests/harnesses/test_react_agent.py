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
                "openforgerl.harnesses.react",
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


def test_chat_retries_overload_and_reports_refusals() -> None:
    """Like the SDKs: 429/5xx and dropped connections are retried (Retry-After honoured); a 400
    is not, and its body reaches the harness's error."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest

    from openforgerl.harnesses.react import APIError, chat

    replies = [(503, b'{"error": "busy"}'), (200, b'{"choices": [{"message": {"role": "assistant"}}]}')]
    seen: list[dict[str, object]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"auth": self.headers["Authorization"], **body})
            code, payload = replies.pop(0) if replies else (400, b'{"error": "bad tools"}')
            self.send_response(code)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1/chat/completions"
    try:
        assert chat(url, "k1", {"model": "policy"}) == {"role": "assistant"}
        assert [s["auth"] for s in seen] == ["Bearer k1", "Bearer k1"] and seen[0]["model"] == "policy"
        with pytest.raises(APIError, match=r"HTTP 400: .*bad tools"):
            chat(url, "k1", {"model": "policy"})
        assert len(seen) == 3  # the 400 was not retried
    finally:
        server.shutdown()
