"""The ORACLE teacher: a rule-based engine that solves tools-tiny (and claw-basic) tasks.

It is an SFT data generator, not a model. Served by the gateway in place of the student's engine,
it answers every call with the next step of the task's solution, written in the Hermes
`<tool_call>` text the student's chat template uses. The gateway records those calls in the
student's own chat template, token for token, so the recorded rollouts are teacher trajectories
ready for SFT (merged samples, loss on the teacher's tokens only).

It acts through the tools of whatever harness asks, read from the tools the template rendered
into the prompt:
- the built-in ReAct harness (`read_file`, `write_file`, `submit`): `tools_tiny.oracle(task)`'s calls;
- an agent CLI: its own file tools where they take a relative `path` (pi's `read` and `write`),
  else its shell tool (`cat a.txt`, `echo 8 > answer.txt`; mini-swe-agent's `bash`, Claude Code's
  `Bash`, Codex's `exec_command`, ...), then the harness's own way to finish: mini-swe-agent's
  submit command, or a final answer in text. claw-basic tasks run their reference solution
  (`solutions/TASK.sh`) through the shell tool.
Side requests (no tools: titles, routers) get a short title, or JSON matching the schema asked for.

The engine sees only token ids, so it finds the task in the prompt: the instruction narrows it to
the tasks that read the same files in the same order; the values come from the tool responses
(the ReAct path picks the one task whose files match them; a CLI's responses are unwrapped first:
mini-swe-agent's `{"returncode", "output"}`, pi's `Command exited with code N`).

A tool response that failed (a task's transient fault: `error: b.txt: Resource temporarily
unavailable`) is not a value: the teacher reads that file again, noting why ("b.txt could not be
read: reading it again."). Demonstrations recorded in a clean environment never show this.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from openforgerl.behaviour import is_error
from openforgerl.engines.base import EngineError
from openforgerl.images import Image
from openforgerl.rl.prompt_tools import (
    SUBMIT_MARKER,
    ShellTool,
    TextReplyEngine,
    rendered_tools,
    shell_tool,
    side_reply,
    tool_call_text,
)
from openforgerl.tasks import Task
from openforgerl.tasks.suites.tools_tiny import ANSWER_FILE, FAMILIES, oracle

# The suites the teacher can solve (tools-tiny-reworded: held-out only, to check, never to train on).
ORACLE_SUITES = ("tools-tiny", "tools-tiny-faults", "tools-tiny-reworded", "tools-tiny-varied", "claw-basic")
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
REACT_TOOLS = {"read_file", "write_file", "submit"}
# File tools an agent CLI may offer (lower-cased names), used when they take a relative `path`.
READ_TOOLS = ("read", "read_file", "view")
WRITE_TOOLS = ("write", "write_file", "create_file")
CONTENT_ARGS = ("content", "contents", "text")
# Lines a CLI's shell tool adds around a command's output (pi; Qwen Code; Codex).
_WRAPPER_LINES = re.compile(
    r"^(Command exited with code -?\d+|\(no output\)|Exit Code: -?\d+|Command: .*|Directory: .*|Output:.*"
    r"|Chunk ID: .*|Wall time: .*|Process exited with code -?\d+|Original token count: \d+)$"
)


class OracleTeacherEngine(TextReplyEngine):
    """An Engine that plays the tools-tiny oracle for `tasks` (logprobs are 0.0: not a sampled policy)."""

    name = "oracle-teacher"

    def __init__(
        self,
        model_dir: str | Path,
        tasks: Sequence[Task],
        *,
        show_work: bool = False,
        solutions: Mapping[str, str] | None = None,
    ) -> None:
        """`solutions`: task id -> a reference shell script (claw-basic's), run through a CLI's shell."""
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self.end_id = self.tokenizer.eos_token_id
        self.max_context = int(self.tokenizer.model_max_length)
        self.tasks = list(tasks)
        self.show_work = show_work
        self.solutions = dict(solutions or {})

    async def load_weights(self, path: str) -> int:
        raise EngineError("the oracle teacher has no weights")

    def _user_text(self, prompt: str) -> str:
        """The task's instruction: the prompt's first user turn (tool responses come later)."""
        start = prompt.find("<|im_start|>user\n")
        end = prompt.find("<|im_end|>", start)
        return prompt[start + len("<|im_start|>user\n") : end] if start >= 0 and end >= 0 else ""

    def reply(self, prompt: str) -> str:
        """The oracle's next step for the conversation so far, through the tools the prompt offers."""
        tools = rendered_tools(prompt)
        if not tools:
            return self._side_reply(prompt)
        if REACT_TOOLS <= {str(t.get("name")) for t in tools}:
            return self._react_reply(prompt)
        return self._cli_reply(prompt, tools)

    def _react_reply(self, prompt: str) -> str:
        instruction = self._user_text(prompt)
        candidates = [t for t in self.tasks if t.instruction == instruction]
        if not candidates:
            raise EngineError("the oracle teacher knows no task with this instruction")
        responses = [r.strip() for r in _RESPONSE.findall(prompt)]
        seen, failed = _values(responses)
        calls = oracle(candidates[0]).calls
        # The reads are the same for every candidate (same files, same order): no need to choose yet.
        if len(seen) < len(calls) - 1:
            return self._noted(candidates[0], seen, calls[len(seen)].text(), failed=failed)
        task = next((t for t in candidates if self._matches(t, seen)), None)
        if task is None:
            raise EngineError("no task's files match the tool responses in the prompt")
        solution = oracle(task)
        if len(seen) < len(solution.calls):
            return self._noted(task, seen, solution.calls[len(seen)].text(), solution.working)
        submit = json.dumps({"name": "submit", "arguments": {"answer": solution.final_answer}})
        return f"<tool_call>\n{submit}\n</tool_call>"

    def _task_in(self, prompt: str) -> Task:
        """The task whose instruction the prompt carries (a CLI wraps it in its own text)."""
        found = [t for t in self.tasks if t.instruction in prompt]
        if not found:
            raise EngineError("the oracle teacher knows no task whose instruction is in this prompt")
        return max(found, key=lambda t: len(t.instruction))  # the most specific one

    def _cli_reply(self, prompt: str, tools: list[dict[str, Any]]) -> str:
        task = self._task_in(prompt)
        shell = shell_tool(tools)
        if shell is None:
            raise EngineError("the oracle teacher needs a shell tool, and this harness offers none")
        responses = _RESPONSE.findall(prompt)
        seen, failed = _values([_output(r) for r in responses], responses)
        script = self.solutions.get(task.id)
        if script is not None:  # a reference solution: run it, then finish
            return shell.call(script) if not seen else self._finish(prompt, shell, "The task is done.")
        if task.metadata.get("family") not in FAMILIES:
            raise EngineError(f"the oracle teacher has no solution for task {task.id}")
        names: list[str] = task.metadata["inputs"]
        if len(seen) < len(names):
            return self._noted(task, seen, self._read(tools, shell, names[len(seen)]), failed=failed)
        family = FAMILIES[task.metadata["family"]]
        values = seen[: len(names)]
        try:
            answer = family.answer(values)
        except ValueError as exc:
            raise EngineError(f"the oracle teacher could not read the values {values}: {exc}") from exc
        if len(seen) == len(names):
            write = self._write(tools, shell, answer)
            return self._noted(task, seen, write, family.working(values, answer))
        return self._finish(prompt, shell, f"{ANSWER_FILE} holds {answer}.")

    @staticmethod
    def _read(tools: list[dict[str, Any]], shell: ShellTool, name: str) -> str:
        tool = _file_tool(tools, READ_TOOLS, ())
        return tool_call_text(tool["name"], {"path": name}) if tool else shell.call(f"cat {name}")

    @staticmethod
    def _write(tools: list[dict[str, Any]], shell: ShellTool, answer: str) -> str:
        tool = _file_tool(tools, WRITE_TOOLS, CONTENT_ARGS)
        if tool is None:
            return shell.call(f"echo {answer} > {ANSWER_FILE}")
        content_arg = next(a for a in CONTENT_ARGS if a in tool["parameters"].get("properties", {}))
        return tool_call_text(tool["name"], {"path": ANSWER_FILE, content_arg: answer + "\n"})

    @staticmethod
    def _finish(prompt: str, shell: ShellTool, text: str) -> str:
        """The harness's own end: mini-swe-agent's submit command when it asks for it, else text."""
        return shell.call(f"echo {SUBMIT_MARKER}") if SUBMIT_MARKER in prompt else text

    def _side_reply(self, prompt: str) -> str:
        """A side request (no tools): JSON for a schema asked for (a router), else a short title."""
        task = next((t for t in self.tasks if t.instruction in prompt), None)
        return side_reply(prompt, " ".join((task.instruction if task else "Solve the task").split()[:6]))

    def _noted(self, task: Task, seen: list[str], call: str, working: str = "", failed: bool = False) -> str:
        """With `show_work`, a call that follows a tool response opens with a note of what it said
        ('a.txt holds "6".'), and the write with the computation ("6 + 2 = 7 + 1 = 8 + 0 = 8."), as a
        teacher that shows its work does: the student then copies each value next to where it was read.
        After a failed read (`failed`) the note says so and the call reads the file again."""
        names: list[str] = task.metadata["inputs"]
        if self.show_work and failed:
            return f"{names[len(seen)]} could not be read: reading it again.\n{call}"
        if not self.show_work or not seen:
            return call
        note = f'{names[len(seen) - 1]} holds "{seen[-1]}".'
        if working:
            note += f" {working}."
        return f"{note}\n{call}"

    @staticmethod
    def _matches(task: Task, seen: list[str]) -> bool:
        assert isinstance(task.files, dict), "tools-tiny tasks carry their files inline"
        names: list[str] = task.metadata["inputs"]
        return [task.files[n].strip() for n in names] == seen[: len(names)]

    def see(self, prompt: str, images: Sequence[Image]) -> None:
        if images:
            raise EngineError("the oracle teacher takes no images")


def _values(outputs: list[str], raw: list[str] | None = None) -> tuple[list[str], bool]:
    """The tool responses that answered (failed ones left out: their file is read again), and
    whether the last one failed. `raw`: the responses before a CLI's wrapping was taken off, which
    carry its exit status."""
    failed = [is_error(r) for r in (raw if raw is not None else outputs)]
    return [o for o, bad in zip(outputs, failed, strict=True) if not bad], bool(failed and failed[-1])


def _output(response: str) -> str:
    """A command's or file tool's output inside a CLI's tool response, without the CLI's wrapping:
    mini-swe-agent's JSON `output`, pi's and Qwen Code's status lines."""
    text = response.strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        text = str(data.get("output", data.get("stdout", data.get("content", ""))))
    lines = [line for line in text.splitlines() if not _WRAPPER_LINES.match(line.strip())]
    return "\n".join(lines).strip()


def _file_tool(tools: list[dict[str, Any]], names: tuple[str, ...], content: tuple[str, ...]) -> Any:
    """A file tool of one of `names` taking a relative `path` (and, for writes, a content argument)."""
    for tool in tools:
        props = (tool.get("parameters") or {}).get("properties") or {}
        if str(tool.get("name", "")).lower() in names and "path" in props:
            if not content or any(arg in props for arg in content):
                return tool
    return None


def reference_solutions() -> dict[str, str]:
    """claw-basic's reference solutions (`solutions/TASK.sh`), by task id."""
    from openforgerl import tasks as tasks_pkg

    folder = Path(tasks_pkg.__file__).parent / "suites" / "claw_basic" / "solutions"
    return {p.stem: _commands(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.sh"))}


def _commands(script: str) -> str:
    """A script's commands as an agent would type them into a shell tool: no shebang, comments or
    bash-only `set -o pipefail` (several CLIs run commands with /bin/sh)."""
    keep = [line for line in script.splitlines() if not line.lstrip().startswith(("#", "set -"))]
    return "\n".join(keep).strip() + "\n"
