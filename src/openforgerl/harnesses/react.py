"""The built-in ReAct harness: a plain tool-calling loop over Chat Completions.

It needs nothing but Python, so it is the default harness where no node is installed. It runs
inside the rollout's sandbox, in the task's work directory, and talks to the gateway like any
other harness: `POST base_url + "/v1/chat/completions"` with the rollout's key.

It speaks the wire format with the standard library rather than the `openai` SDK: a harness
process starts once per rollout, and importing `openai` costs about 1.3 s of CPU (its pydantic
types), `httpx` 0.27 s, `urllib` 0.09 s; on a 2-core machine the SDK's import was most of a
tools-tiny rollout's cost. Retries follow the SDK's rules (connection errors, 408, 409, 429, 5xx;
exponential back-off, `Retry-After` honoured).

    python -m openforgerl.harnesses.react --base-url URL --api-key KEY --task "..." [--max-turns 16]

It prints one JSON line at the end: turns taken, why it stopped, the submitted answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openforgerl.faults import ToolFaults
from openforgerl.harnesses import builtin

SYSTEM_PROMPT = (
    "You are an agent working in a workspace directory. Use the tools to inspect and change files. "
    "Call one tool at a time. When the task is done, call submit with a short answer."
)
OUTPUT_LIMIT = 8000  # characters of tool output shown to the model; the rest is elided

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the workspace and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file in the workspace (created or replaced).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish the task with a short final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    },
]


@dataclass
class Outcome:
    turns: int = 0
    stopped: str = ""  # submitted | no_tool_call | max_turns | api_error
    answer: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    errors: list[str] = field(default_factory=list)


def _clip(text: str) -> str:
    if len(text) <= OUTPUT_LIMIT:
        return text
    half = OUTPUT_LIMIT // 2
    return f"{text[:half]}\n[... {len(text) - OUTPUT_LIMIT} characters elided ...]\n{text[-half:]}"


def _inside(workdir: Path, path: str) -> Path:
    target = (workdir / path).resolve()
    if not target.is_relative_to(workdir.resolve()):
        raise ValueError(f"path {path!r} is outside the workspace")
    return target


def run_tool(
    name: str, args: dict[str, Any], workdir: Path, timeout: float, faults: ToolFaults | None = None
) -> str:
    """Execute one tool call; failures come back as text for the model, never as a crash. A task's
    transient fault (`faults`) answers a matching call with its error instead."""
    if faults is not None and name in ("bash", "read_file", "write_file"):
        called = str(args.get("command" if name == "bash" else "path", ""))
        if (error := faults.error(name, called)) is not None:
            raise OSError(error)
    if name == "bash":
        try:
            proc = subprocess.run(
                ["bash", "-c", str(args["command"])],
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=timeout,
                errors="replace",
            )
        except subprocess.TimeoutExpired:
            return f"error: the command timed out after {timeout:.0f} s"
        return _clip(f"exit code {proc.returncode}\n{proc.stdout}{proc.stderr}")
    if name == "read_file":
        return _clip(_inside(workdir, str(args["path"])).read_text(errors="replace"))
    if name == "write_file":
        target = _inside(workdir, str(args["path"]))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(str(args["content"]))
        return f"wrote {len(str(args['content']))} characters to {args['path']}"
    raise ValueError(f"unknown tool {name!r}; the tools are bash, read_file, write_file, submit")


RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class APIError(Exception):
    """The endpoint failed the call after every retry (or refused it outright)."""


def _retry_delay(attempt: int, retry_after: str | None) -> float:
    if retry_after and retry_after.replace(".", "", 1).isdigit() and float(retry_after) <= 60:
        return float(retry_after)
    return min(0.5 * 2**attempt, 8.0)


def chat(
    url: str, api_key: str, body: dict[str, Any], retries: int = 4, timeout: float = 600
) -> dict[str, Any]:
    """One Chat Completions call to `url`; returns the reply's first message (a dict, as on the wire)."""
    data = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    for attempt in range(retries + 1):
        retry_after = None
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as r:
                message: dict[str, Any] = json.loads(r.read())["choices"][0]["message"]
                return message
        except urllib.error.HTTPError as exc:
            if exc.code not in RETRY_STATUS or attempt == retries:
                raise APIError(f"HTTP {exc.code}: {exc.read()[:2000].decode(errors='replace')}") from exc
            retry_after = exc.headers.get("retry-after")
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            if attempt == retries:
                raise APIError(f"{type(exc).__name__}: {exc}") from exc
        time.sleep(_retry_delay(attempt, retry_after))
    raise AssertionError("unreachable")


def run(
    base_url: str,
    api_key: str,
    task: str,
    *,
    model: str = "policy",
    max_turns: int = 16,
    max_tokens: int | None = None,
    workdir: Path = Path("."),
    tool_timeout: float = 60.0,
) -> Outcome:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task},
    ]
    out = Outcome()
    faults = ToolFaults.from_env()
    while out.turns < max_turns:
        out.turns += 1
        body: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS}
        if max_tokens:
            body["max_tokens"] = max_tokens
        try:
            msg = chat(url, api_key, body)
        except (APIError, ValueError, KeyError, IndexError, TypeError) as exc:
            out.stopped = "api_error"
            out.errors.append(f"{type(exc).__name__}: {exc}")
            return out
        # The assistant turn goes back as sent, without null fields or reasoning.
        messages.append({k: v for k, v in msg.items() if v is not None and k != "reasoning_content"})
        calls = msg.get("tool_calls") or []
        if not calls:
            out.stopped = "no_tool_call"
            out.answer = msg.get("content")
            return out
        for call in calls:
            fn = call.get("function")
            if not isinstance(fn, dict):
                continue
            out.tool_calls += 1
            try:
                args = json.loads(fn.get("arguments") or "{}")
                if not isinstance(args, dict):
                    raise ValueError("arguments must be a JSON object")
                if fn.get("name") == "submit":
                    out.stopped, out.answer = "submitted", str(args.get("answer", ""))
                    return out
                result = run_tool(str(fn.get("name")), args, workdir, tool_timeout, faults)
            except (ValueError, KeyError, OSError) as exc:
                out.tool_errors += 1
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    out.stopped = "max_turns"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = builtin.command_line(__doc__)
    ap.add_argument("--max-turns", type=int, default=16)
    ap.add_argument("--tool-timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    out = run(**builtin.common_args(a), max_turns=a.max_turns, tool_timeout=a.tool_timeout)
    builtin.report(out)
    return 0 if out.stopped != "api_error" else 2


if __name__ == "__main__":
    sys.exit(main())
