"""ScriptedPolicyEngine: a SCRIPTED engine that plays one fixed policy, to drive real harnesses
deterministically in tests (never a product default).

It reads the prompt the gateway rendered with the tiny model's chat template, finds the shell tool
among the tools in the system turn, and counts the tool results already in the conversation:

    0 results -> call the shell tool: printf 'forge-ok' > result.txt
    1 result  -> call it again:       cat result.txt
    2 or more -> a final text answer (for mini-swe-agent, whose instructions ask for it, the
                 command `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` instead)

Side requests get answers that fit them: with no tools, a JSON object matching the first JSON
schema in the system turn (Gemini CLI's router), or else a short title-like text. Replies are encoded
with the real tokenizer and end with the turn-end token, as the tiny model would sample them:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from openforgerl.engines.base import GenerateResult, SamplingParams
from openforgerl.images import Image
from openforgerl.testing.scripted_engine import text_reply

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
        body = json.dumps({"name": self.name, "arguments": arguments}, ensure_ascii=False)
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


class ScriptedPolicyEngine:
    """An Engine (see engines/base.py) whose every answer comes from `reply(prompt text)`."""

    name = "scripted-policy"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        filename: str = "result.txt",
        content: str = "forge-ok",
        commands: Sequence[str] | None = None,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        end_id = self.tokenizer.convert_tokens_to_ids(TURN_END)
        assert isinstance(end_id, int)
        self.end_id = end_id
        self.filename = filename
        self.content = content
        # Shell commands to run instead of write-then-read (e.g. a task's reference solution).
        self.commands = (
            list(commands)
            if commands is not None
            else [
                f"printf '{content}' > {filename}",
                f"cat {filename}",
            ]
        )
        self.prompts: list[str] = []
        self.images: list[list[Image]] = []  # per call: the prompt's images (the policy ignores them)
        self._version = 0

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def load_weights(self, path: str) -> int:
        self._version += 1
        return self._version

    def reply(self, prompt: str) -> str:
        tools = rendered_tools(prompt)
        if not tools:
            schema = json_schema_in(system_text(prompt))
            if schema is not None:
                return json.dumps(example_value(schema), ensure_ascii=False)
            return f"Write {self.content} to {self.filename}"
        shell = shell_tool(tools)
        done = prompt.count(TOOL_RESPONSE)
        if shell is None:
            return f"I have no shell tool, so I cannot write {self.filename}."
        if done < len(self.commands):
            return shell.call(self.commands[done])
        if SUBMIT_MARKER in prompt:
            return shell.call(f"echo {SUBMIT_MARKER}")
        return f"Done: {self.filename} contains {self.content}."

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> GenerateResult:
        prompt = str(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        self.prompts.append(prompt)
        self.images.append(list(images))
        return text_reply(self.tokenizer, self.end_id, self.reply(prompt), sampling, self._version)
