"""`make demo`: a tiny local model served by the gateway, and the official OpenAI client talking to it.

Until the training loop exists this is the main job on the embedded default: make the model,
start `openforge gateway` on it, open a rollout, hold a multi-turn, tool-using conversation with
the real `openai` SDK (plain and streaming), then show what the gateway recorded at token level.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from openforgerl.gateway.server import free_port

ADMIN = "demo-admin-token"
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited with code {proc.returncode}; see its output above")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the gateway did not answer on {url} within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> None:
    from openai import OpenAI

    from openforgerl.modelkit import init_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default=".demo")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    args = ap.parse_args(argv)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)

    print(f"[1/4] making a {args.size} model in {work / 'model'} (BPE tokenizer, chat template, Qwen2)")
    model_dir = init_model(work / "model", size=args.size, seed=0)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = work / "gateway.db"
    print(f"[2/4] starting the gateway on {url} (store {store})")
    cmd = [sys.executable, "-m", "openforgerl.cli", "gateway", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--store", str(store), "--admin-token", ADMIN, "--max-tokens", "48"]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_ready(url, proc)
        admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
        rollout = admin.post("/admin/rollouts", json={"run_id": "demo", "task_id": "hello"}).json()
        print(f"      rollout {rollout['rollout_id']}  base_url {rollout['base_url']}")

        print("[3/4] a real OpenAI client holds a 4-turn, tool-using conversation through the gateway")
        client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
        messages: list[Any] = [
            {"role": "system", "content": "You are a coding agent. Use tools when useful."},
            {"role": "user", "content": "What is in notes.txt?"},
        ]
        for turn in range(4):
            if turn % 2 == 0:
                reply = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
                msg = reply.choices[0].message
                text, finish = msg.content or "", reply.choices[0].finish_reason
                messages.append(msg.model_dump(exclude_none=True))
            else:
                stream = client.chat.completions.create(
                    model="claude-sonnet",
                    messages=messages,
                    tools=TOOLS,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                parts, finish = [], None
                for chunk in stream:
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                text = "".join(parts)
                messages.append({"role": "assistant", "content": text})
            mode = "streamed" if turn % 2 else "plain"
            print(f"      turn {turn + 1} ({mode}, finish={finish}): {text[:70]!r}")
            messages.append(
                {"role": "user", "content": f"Thanks. Now step {turn + 2}: list the files again."}
                if turn % 2
                else {"role": "user", "content": "notes.txt says: buy milk. Summarise it."}
            )

        print("[4/4] what the gateway recorded (token level)")
        calls = admin.get(f"/admin/rollouts/{rollout['rollout_id']}/calls").json()["calls"]
        print("      call branch model          prompt reused completion version finish  branch reason")
        previous: list[int] = []
        extends = 0
        for c in calls:
            if previous and c["prompt_ids"][: len(previous)] == previous:
                extends += 1
            previous = c["prompt_ids"] + c["completion_ids"]
            print(
                f"      {c['seq']:>4} {c['branch_id']:>6} {c['model']:<14} {len(c['prompt_ids']):>6} "
                f"{c['reused_prompt_tokens']:>6} {len(c['completion_ids']):>10} {c['policy_version']:>7} "
                f"{c['finish_reason']:<7} {c['branch_reason'] or '(extends the previous call)'}"
            )
        print(
            f"      {extends} of {len(calls) - 1} follow-up calls extend the previous call's exact ids "
            "(no re-tokenisation): one training sequence"
        )
        admin.post(f"/admin/rollouts/{rollout['rollout_id']}/close", json={"reward": 1.0})
        print(f"done. Records are in {store}.")
        print(
            f"See the recorded rollout: .venv/bin/openforge view --store {store} --model {model_dir}\n"
            "  then open http://127.0.0.1:8600/#/run/demo"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
