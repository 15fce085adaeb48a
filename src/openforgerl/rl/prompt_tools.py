"""What a prompt rendered with the kit's chat template offers a policy, and replies written as text.

The template renders a request's tools as one JSON object per line inside `<tools>` in the system
turn, and tool results as `<tool_response>` blocks. Rule-based policies (the ORACLE teacher, and the
scripted test policies) read them to act through whatever tools a harness offers: its shell tool
(`bash`, `exec_command`, `run_shell_command`, ...), and its file tools where it has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openforgerl.engines.base import EngineBase, GenerateResult, Generation, SamplingParams
from openforgerl.images import Image

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SYSTEM_START = "<|im_start|>system\n"
TURN_END = "<|im_end|>"
TOOLS_END = "\n</tools>\n\nFor each function call"
TOOL_RESPONSE = "\n<tool_response>\n"
# Argument names a shell tool takes its command line in, and name hints ranking the candidates.
COMMAND_ARGS = ("command", "cmd")
SHELL_HINTS = ("bash", "shell", "exec", "command", "run")


@dataclass(frozen=True, slots=True)
class ShellTool:
    name: str
    command_arg: str
    schema: Mapping[str, Any]  # the tool's JSON schema for its arguments

    def call(self, command: str) -> str:
        """The tool call as the chat template renders it, required arguments filled in."""
        arguments: dict[str, Any] = {self.command_arg: command}
        props = self.schema.get("properties") or {}
        for name in self.schema.get("required") or []:
            if name not in arguments:
                arguments[name] = example_value(props.get(name) or {}, name)
        return tool_call_text(self.name, arguments)


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the chat template renders it (Hermes/Qwen `<tool_call>` JSON)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def rendered_tools(prompt: str) -> list[dict[str, Any]]:
    """The tools the template rendered into the system turn: one JSON object per line before `</tools>`."""
    end = prompt.find(TOOLS_END)
    if end < 0:
        return []
    tools = []
    for line in reversed(prompt[:end].split("\n")):
        try:
            tool = json.loads(line)
        except ValueError:
            break  # the `<tools>` line: the list starts after it
        if not isinstance(tool, dict):
            break
        tools.append(tool.get("function", tool))
    return tools[::-1]


def shell_tool(tools: list[dict[str, Any]]) -> ShellTool | None:
    """The tool that runs a command line: a required string `command`/`cmd` argument, ranked by name."""
    found: list[tuple[int, int, ShellTool]] = []
    for index, tool in enumerate(tools):
        schema = tool.get("parameters") or {}
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        for arg in COMMAND_ARGS:
            if arg in required and (props.get(arg) or {}).get("type", "string") == "string":
                name = str(tool.get("name", ""))
                rank = next(
                    (i for i, hint in enumerate(SHELL_HINTS) if hint in name.lower()), len(SHELL_HINTS)
                )
                found.append((rank, index, ShellTool(name, arg, schema)))
                break
    return min(found, key=lambda f: (f[0], f[1]))[2] if found else None


def system_text(prompt: str) -> str:
    start = prompt.find(SYSTEM_START)
    if start < 0:
        return ""
    start += len(SYSTEM_START)
    end = prompt.find(TURN_END, start)
    return prompt[start : end if end >= 0 else len(prompt)]


def json_schema_in(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text` that looks like an object schema (has `properties`)."""
    decoder = json.JSONDecoder()
    at = text.find("{")
    while at >= 0:
        try:
            value, _ = decoder.raw_decode(text, at)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("properties"), dict):
            return value
        at = text.find("{", at + 1)
    return None


def example_value(schema: Mapping[str, Any], name: str = "") -> Any:
    """A small value that satisfies a simple JSON schema (Gemini writes types in capitals)."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = str(schema.get("type", "string")).lower()
    if kind == "object":
        props = schema.get("properties") or {}
        return {key: example_value(sub, key) for key, sub in props.items()}
    if kind == "array":
        return []
    if kind == "boolean":
        return False
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    return f"scripted {name}".strip() if name else "scripted"


def side_reply(prompt: str, title: str) -> str:
    """A side request's answer (no tools offered): JSON matching the object schema the system turn
    asks for (Gemini CLI's router), else `title` (a title generator)."""
    schema = json_schema_in(system_text(prompt))
    return json.dumps(example_value(schema), ensure_ascii=False) if schema is not None else title


def text_reply(
    tokenizer: Any, end_id: int, text: str, sampling: SamplingParams, version: int, logprob: float = 0.0
) -> GenerateResult:
    """`text` as a model would have sampled it: its ids cut at max_tokens, else ended by the turn-end
    id (kept as the last id, as engines do), with a constant logprob."""
    ids = tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens]
    if len(ids) < sampling.max_tokens:
        ids.append(end_id)
        return GenerateResult(ids, [logprob] * len(ids), "stop", version, end_id)
    return GenerateResult(ids, [logprob] * len(ids), "length", version)


class TextReplyEngine(EngineBase):
    """An Engine (engines/base.py) whose every answer is text from `reply(prompt text)`, returned
    as a model would have sampled it (`text_reply`): the rule-based policies' common part.
    Subclasses set `tokenizer` and `end_id`, and write `reply`; `see` is shown each prompt."""

    name = "text-reply"
    max_context: int | None = None  # no limit of its own: the gateway's applies
    supports_response_format = False
    tokenizer: Any
    end_id: int
    _version = 0

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def reply(self, prompt: str) -> str:
        raise NotImplementedError

    def see(self, prompt: str, images: Sequence[Image]) -> None:
        """Called with each prompt (decoded, special tokens kept) and its images before `reply`."""

    async def _generate(self, call: Generation) -> GenerateResult:
        prompt = str(self.tokenizer.decode(call.prompt_ids, skip_special_tokens=False))
        self.see(prompt, call.images)
        return text_reply(self.tokenizer, self.end_id, self.reply(prompt), call.sampling, self._version)
