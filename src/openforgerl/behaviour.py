"""How an agent acted, read from its recorded conversation, for any harness.

The gateway records each call's new messages and its answer in one shape whatever the dialect
(`conversation.Message.template_dict`), so the same reading serves the ReAct harness and every
agent CLI. Per rollout:

- `tool_calls`, `tool_errors`: actions taken, and how many of them failed. A tool response is an
  error when it says so the way harnesses do: `error: ...` / `Error: ...` (ReAct, Anthropic's
  `is_error`), or a command's non-zero exit status (`exit code 1`, `Command exited with code 1`,
  `Exit Code: 1`, `Process exited with code 1`, mini-swe-agent's `returncode`).
- `error_seen`: at least one action failed.
- `recovered`: every failed action's target (its path, else its command, else its arguments) was
  later acted on successfully: the same action again, or another one on the same thing (`cat b.txt`
  after `read_file b.txt` failed). `gave_up`: an action failed and its target never succeeded.
  Both are None when nothing failed.
- `self_verified`: after its last write (a write tool's path, or a shell redirection `> path`), the
  agent read that file back before finishing; None when it wrote nothing.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_EXIT = re.compile(
    r"(?:^|\n)\s*(?:exit code|command exited with code|exit code:|process exited with code)\s*:?\s*(-?\d+)",
    re.I,
)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_REDIRECT = re.compile(r">>?\s*['\"]?([^\s'\";|&>]+)")
PATH_ARGS = ("path", "file_path", "filePath", "filename", "file")
COMMAND_ARGS = ("command", "cmd", "script")
WRITE_WORDS = ("write", "create", "edit", "replace", "patch")


@dataclass(frozen=True, slots=True)
class Step:
    """One action and what it answered."""

    name: str
    arguments: dict[str, Any] | str
    output: str
    ok: bool

    @property
    def target(self) -> str:
        """What the action acted on: its path, else its command line, else its arguments."""
        args = self.arguments
        if isinstance(args, dict):
            for key in (*PATH_ARGS, *COMMAND_ARGS):
                if isinstance(args.get(key), str) and args[key].strip():
                    return args[key].strip()
            return json.dumps(args, sort_keys=True)
        return str(args)

    def mentions(self, target: str) -> bool:
        args = self.arguments
        text = json.dumps(args, sort_keys=True) if isinstance(args, dict) else str(args)
        return target == self.target or target in text

    @property
    def written(self) -> str | None:
        """The file this action wrote, if it is a write: a write tool's path, a shell redirection."""
        args = self.arguments if isinstance(self.arguments, dict) else {}
        if any(w in self.name.lower() for w in WRITE_WORDS):
            path = next((args[k] for k in PATH_ARGS if isinstance(args.get(k), str)), None)
            if path:
                return str(path).strip()
        command = next((args[k] for k in COMMAND_ARGS if isinstance(args.get(k), str)), None)
        found = _REDIRECT.findall(command) if command else []
        return found[-1] if found else None


def is_error(output: str) -> bool:
    """Whether a tool response says the action failed (see the module's doc)."""
    text = output.strip()
    if text[:6].lower() == "error:" or text.lower().startswith("error "):
        return True
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("returncode", "exit_code", "exitCode"):
            if isinstance(data.get(key), int):
                return bool(data[key] != 0)
    found = _EXIT.search(text) or _RETURNCODE.search(text)
    return bool(found and int(found.group(1)) != 0)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def steps(messages: Sequence[Mapping[str, Any]]) -> list[Step]:
    """The actions of a conversation, each with its tool response (by id, else in order)."""
    out: list[Step] = []
    pending: list[tuple[str, str, dict[str, Any] | str]] = []
    for m in messages:
        if m.get("role") == "assistant":
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                        args = parsed if isinstance(parsed, dict) else args
                    except ValueError:
                        pass
                pending.append((str(call.get("id", "")), str(fn.get("name", "")), args or {}))
        elif m.get("role") == "tool" and pending:
            key = str(m.get("tool_call_id", ""))
            at = next((i for i, p in enumerate(pending) if key and p[0] == key), 0)
            _, name, args = pending.pop(at)
            output = _text(m.get("content"))
            out.append(Step(name, args, output, not is_error(output)))
    return out


def of_conversation(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The behaviour metrics of one conversation (see the module's doc)."""
    acts = steps(messages)
    failed = [(i, s) for i, s in enumerate(acts) if not s.ok]
    recovered: bool | None = None
    if failed:
        recovered = all(any(t.ok and t.mentions(s.target) for t in acts[i + 1 :]) for i, s in failed)
    writes = [(i, s.written) for i, s in enumerate(acts) if s.ok and s.written]
    verified: bool | None = None
    if writes:
        last, path = writes[-1]
        verified = any(t.ok and t.written is None and t.mentions(str(path)) for t in acts[last + 1 :])
    return {
        "tool_calls": len(acts),
        "tool_errors": len(failed),
        "error_seen": bool(failed),
        "recovered": recovered,
        "gave_up": None if recovered is None else not recovered,
        "self_verified": verified,
    }


class CallRecord(Protocol):
    """What the main conversation is read from: a recorded call (openforgerl.rollouts.trajectory's
    RecordedCall, as the gateway's GET /admin/rollouts/{id}/calls gives it)."""

    @property
    def call_id(self) -> int: ...
    @property
    def parent_call_id(self) -> int | None: ...
    @property
    def status(self) -> str: ...
    @property
    def side_request(self) -> str: ...
    @property
    def messages_delta(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def response(self) -> Mapping[str, Any]: ...


def main_conversation(calls: Sequence[CallRecord]) -> list[dict[str, Any]]:
    """The conversation of a rollout's main thread, from its recorded calls: the path of parent calls
    ending at the last answered call that is not a side request, each call's new messages followed
    by its answer."""
    ok = [c for c in calls if c.status == "ok" and not c.side_request]
    if not ok:
        return []
    by_id = {c.call_id: c for c in ok}
    path: list[CallRecord] = []
    call: CallRecord | None = ok[-1]
    while call is not None:
        path.append(call)
        call = by_id.get(call.parent_call_id) if call.parent_call_id is not None else None
    messages: list[dict[str, Any]] = []
    for c in reversed(path):
        messages += [dict(m) for m in c.messages_delta]
        if c.response:
            messages.append(dict(c.response))
    return messages


RATES = {  # aggregate name -> (per-rollout key, rollouts it is a fraction of)
    "error_rate": ("error_seen", "all"),
    "recovery_rate": ("recovered", "error_seen"),
    "gave_up_rate": ("gave_up", "error_seen"),
    "self_verification_rate": ("self_verified", "wrote"),
}


def aggregate(per_rollout: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Means and rates over rollouts: `recovery_rate` and `gave_up_rate` of the rollouts that met an
    error (None when none did), `self_verification_rate` of those that wrote a file."""
    rows = list(per_rollout)
    if not rows:
        return {}
    out: dict[str, Any] = {"rollouts": len(rows)}
    out["tool_calls_mean"] = round(statistics.fmean(r["tool_calls"] for r in rows), 3)
    out["tool_errors_mean"] = round(statistics.fmean(r["tool_errors"] for r in rows), 3)
    out["rollouts_with_errors"] = sum(1 for r in rows if r["error_seen"])
    for name, (key, among) in RATES.items():
        pool = [r[key] for r in rows if r.get(key) is not None] if among != "all" else [r[key] for r in rows]
        out[name] = round(sum(1 for v in pool if v) / len(pool), 4) if pool else None
    return out
