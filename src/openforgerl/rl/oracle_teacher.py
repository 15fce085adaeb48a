"""The ORACLE teacher for tools-tiny: a rule-based engine that plays `tools_tiny.oracle(task)`.

It is an SFT data generator, not a model. Served by the gateway in place of the student's engine,
it answers every call of the ReAct harness with the oracle's next tool call (in the Hermes
`<tool_call>` text the student's chat template uses), then `submit`. The gateway records those
calls in the student's own chat template, token for token, so the recorded rollouts are teacher
trajectories ready for SFT (merged samples, loss on the teacher's tokens only).

The engine sees only token ids, so it finds the task in the prompt: the instruction narrows it to
the tasks that read the same files in the same order; once the files' contents are in the prompt
(as tool responses), they pick the one task whose files match.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openforgerl.engines.base import EngineError, GenerateResult, SamplingParams
from openforgerl.images import Image
from openforgerl.tasks import Task
from openforgerl.tasks.suites.tools_tiny import oracle
from openforgerl.testing.scripted_engine import text_reply

_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


class OracleTeacherEngine:
    """An Engine that plays the tools-tiny oracle for `tasks` (logprobs are 0.0: not a sampled policy)."""

    name = "oracle-teacher"

    def __init__(self, model_dir: str | Path, tasks: Sequence[Task], *, show_work: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self.end_id = self.tokenizer.eos_token_id
        self.max_context = int(self.tokenizer.model_max_length)
        self.tasks = list(tasks)
        self.show_work = show_work

    @property
    def policy_version(self) -> int:
        return 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def load_weights(self, path: str) -> int:
        raise EngineError("the oracle teacher has no weights")

    def _user_text(self, prompt: str) -> str:
        """The task's instruction: the prompt's first user turn (tool responses come later)."""
        start = prompt.find("<|im_start|>user\n")
        end = prompt.find("<|im_end|>", start)
        return prompt[start + len("<|im_start|>user\n") : end] if start >= 0 and end >= 0 else ""

    def reply(self, prompt: str) -> str:
        """The oracle's next step for the conversation so far."""
        instruction = self._user_text(prompt)
        candidates = [t for t in self.tasks if t.instruction == instruction]
        if not candidates:
            raise EngineError("the oracle teacher knows no task with this instruction")
        seen = [r.strip() for r in _RESPONSE.findall(prompt)]
        calls = oracle(candidates[0]).calls
        # The reads are the same for every candidate (same files, same order): no need to choose yet.
        if len(seen) < len(calls) - 1:
            return self._noted(candidates[0], seen, calls[len(seen)].text())
        task = next((t for t in candidates if self._matches(t, seen)), None)
        if task is None:
            raise EngineError("no task's files match the tool responses in the prompt")
        solution = oracle(task)
        if len(seen) < len(solution.calls):
            return self._noted(task, seen, solution.calls[len(seen)].text(), solution.working)
        submit = json.dumps({"name": "submit", "arguments": {"answer": solution.final_answer}})
        return f"<tool_call>\n{submit}\n</tool_call>"

    def _noted(self, task: Task, seen: list[str], call: str, working: str = "") -> str:
        """With `show_work`, a call that follows a tool response opens with a note of what it said
        ('a.txt holds "6".'), and the write with the computation ("6 + 2 = 7 + 1 = 8 + 0 = 8."), as a
        teacher that shows its work does: the student then copies each value next to where it was read."""
        if not self.show_work or not seen:
            return call
        names: list[str] = task.metadata["inputs"]
        note = f'{names[len(seen) - 1]} holds "{seen[-1]}".'
        if working:
            note += f" {working}."
        return f"{note}\n{call}"

    @staticmethod
    def _matches(task: Task, seen: list[str]) -> bool:
        assert isinstance(task.files, dict), "tools-tiny tasks carry their files inline"
        names: list[str] = task.metadata["inputs"]
        return [task.files[n].strip() for n in names] == seen[: len(names)]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> GenerateResult:
        if images:
            raise EngineError("the oracle teacher takes no images")
        return text_reply(
            self.tokenizer, self.end_id, self.reply(self.tokenizer.decode(prompt_ids)), sampling, 0
        )
