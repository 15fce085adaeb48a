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

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from openforgerl.images import Image
from openforgerl.rl.prompt_tools import (
    SUBMIT_MARKER,
    TOOL_RESPONSE,
    TURN_END,
    TextReplyEngine,
    rendered_tools,
    shell_tool,
    side_reply,
)


class ScriptedPolicyEngine(TextReplyEngine):
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

    async def load_weights(self, path: str) -> int:
        self._version += 1
        return self._version

    def reply(self, prompt: str) -> str:
        tools = rendered_tools(prompt)
        if not tools:
            return side_reply(prompt, f"Write {self.content} to {self.filename}")
        shell = shell_tool(tools)
        done = prompt.count(TOOL_RESPONSE)
        if shell is None:
            return f"I have no shell tool, so I cannot write {self.filename}."
        if done < len(self.commands):
            return shell.call(self.commands[done])
        if SUBMIT_MARKER in prompt:
            return shell.call(f"echo {SUBMIT_MARKER}")
        return f"Done: {self.filename} contains {self.content}."

    def see(self, prompt: str, images: Sequence[Image]) -> None:
        self.prompts.append(prompt)
        self.images.append(list(images))
