"""The request bodies of the gateway-overhead benchmark (shared by the load generator and the driver).

Only the standard library and orjson: this module runs in the main venv (the driver) and in
.venv-bench (the load generator).

Two request shapes, both `stream: true` with `stream_options.include_usage`:

- small: one user turn, one tool, about 2 KB.
- harness: a coding-agent conversation with 12 tools. Turn t holds the system prompt, the task and
  t-1 (assistant tool call, tool result) pairs; turn 30 is about 100 KB. The assistant turns are the
  completion the fake engine always answers (`read_file` on FAKE_PATH), echoed back the way an
  OpenAI client does, so the gateway's token memory extends the rollout's branch on every turn.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

FAKE_MODEL = "fake-model"  # the fake engine's model name (direct path)
LITELLM_MODEL = "fake-openai"  # LiteLLM's alias for it
GATEWAY_MODEL = "policy"

FAKE_TOOL = "read_file"
FAKE_PATH = "src/app/module_07.py"
FAKE_ARGUMENTS = {"path": FAKE_PATH}
# What the fake engine samples, as text; /v1/completions returns its token ids plus the turn end.
FAKE_COMPLETION_TEXT = (
    f'<tool_call>\n{{"name": "{FAKE_TOOL}", "arguments": {{"path": "{FAKE_PATH}"}}}}\n</tool_call>'
)

HARNESS_TURNS = 30
TOOL_RESULT_CHARS = 2950  # makes turn 30 about 100 KB

_WORDS = (
    "self value result index items config request response buffer token cache handler session "
    "return import from class def async await with yield raise except finally lambda None True "
    "False path name data count offset limit status error message stream client server engine "
    "rollout branch prefix memory render encode decode parse record store commit policy sample"
).split()


def _code_like(rng: random.Random, chars: int) -> str:
    """Deterministic text that looks like source code (tokenizes like it, too)."""
    lines: list[str] = []
    size = 0
    while size < chars:
        indent = "    " * rng.randint(0, 3)
        words = rng.sample(_WORDS, rng.randint(3, 8))
        kind = rng.random()
        if kind < 0.3:
            line = f"{indent}{words[0]}_{words[1]} = {words[2]}({', '.join(words[3:])})"
        elif kind < 0.5:
            line = f"{indent}def {words[0]}_{words[1]}({', '.join(words[2:])}) -> {words[-1].title()}:"
        elif kind < 0.65:
            line = f"{indent}# {' '.join(words)}."
        elif kind < 0.8:
            line = f"{indent}if {words[0]}.{words[1]} is not None and {words[2]} > {rng.randint(0, 999)}:"
        else:
            line = f"{indent}return {{{words[0]!r}: {words[1]}, {words[2]!r}: {rng.random():.4f}}}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


def _tool(name: str, description: str, props: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                "required": list(props)[:1],
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool(
        FAKE_TOOL,
        "Read a file of the repository and return its contents with line numbers.",
        {"path": "Path relative to the repository root.", "start": "First line.", "end": "Last line."},
    ),
    _tool(
        "write_file",
        "Create or overwrite a file with the given content.",
        {"path": "Path relative to the repository root.", "content": "The new content of the file."},
    ),
    _tool(
        "edit_file",
        "Replace an exact, unique snippet of a file with another.",
        {"path": "The file.", "old": "The exact text to replace.", "new": "The replacement text."},
    ),
    _tool(
        "list_dir",
        "List the entries of a directory, with sizes, up to a depth.",
        {"path": "The directory.", "depth": "How deep to recurse (default 1)."},
    ),
    _tool(
        "grep",
        "Search files for a regular expression and return the matching lines with their locations.",
        {"pattern": "A Python regular expression.", "path": "Where to search.", "glob": "File filter."},
    ),
    _tool(
        "run_shell",
        "Run a shell command in the sandbox and return its exit status, stdout and stderr.",
        {"command": "The command line.", "timeout": "Seconds before the command is killed."},
    ),
    _tool(
        "run_tests",
        "Run the project's test suite or a subset of it and return the summary and failures.",
        {"selector": "A pytest node id or -k expression.", "verbose": "Show every test."},
    ),
    _tool(
        "git_diff",
        "Show the diff of the working tree against a revision.",
        {"revision": "The revision to diff against (default HEAD).", "path": "Limit to a path."},
    ),
    _tool(
        "search_symbols",
        "Find definitions of functions, classes and variables by name across the code base.",
        {"name": "The symbol name or a prefix of it.", "kind": "function, class or variable."},
    ),
    _tool(
        "web_fetch",
        "Fetch a documentation page and return its text (network access is restricted).",
        {"url": "The page's address.", "max_chars": "Truncate the text to this many characters."},
    ),
    _tool(
        "ask_user",
        "Ask the user a clarifying question and wait for the answer.",
        {"question": "The question, self-contained.", "options": "Suggested answers, comma-separated."},
    ),
    _tool(
        "finish",
        "Declare the task done with a summary of the changes and how they were verified.",
        {"summary": "What changed and why.", "verification": "How it was tested."},
    ),
]

SYSTEM_PROMPT = (
    "You are a careful software engineer working in a sandboxed checkout of a Python repository. "
    "Use the tools to inspect the code, make minimal changes and verify them with the tests. "
    "Never guess file contents: read them first. Keep edits small and explain each one briefly. "
) * 6


def _task(rng: random.Random) -> str:
    return (
        "The function `load_config` in src/app/module_07.py crashes when the configuration file has "
        "an empty `[server]` section. Find the cause, fix it, add a regression test and make sure "
        "the whole suite passes. Context from the issue tracker follows.\n\n" + _code_like(rng, 600)
    )


def _assistant(turn: int) -> dict[str, Any]:
    """The fake engine's completion as an OpenAI client echoes it back."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{turn:04d}",
                "type": "function",
                "function": {"name": FAKE_TOOL, "arguments": orjson.dumps(FAKE_ARGUMENTS).decode()},
            }
        ],
    }


def harness_messages(seed: int = 0, turns: int = HARNESS_TURNS) -> list[list[dict[str, Any]]]:
    """The messages of turns 1..turns of one conversation (each a list extending the previous)."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": _task(rng)},
    ]
    out = [list(history)]
    for turn in range(1, turns):
        history.append(_assistant(turn))
        history.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{turn:04d}",
                "content": _code_like(rng, TOOL_RESULT_CHARS),
            }
        )
        out.append(list(history))
    return out


def small_messages(seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed + 1000)
    return [
        {"role": "system", "content": "You are a concise assistant with access to the repository."},
        {
            "role": "user",
            "content": "Please look at this and read the file it mentions.\n" + _code_like(rng, 1200),
        },
    ]


def body(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "tools": tools,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 256,
        }
    )


def bodies(model: str, turns: int = HARNESS_TURNS) -> dict[str, list[bytes]]:
    """{"small": [body], "harness": [turn 1 body, ..., turn `turns` body]} for one path's model name."""
    return {
        "small": [body(model, small_messages(), TOOLS[:1])],
        "harness": [body(model, m, TOOLS) for m in harness_messages(turns=turns)],
    }


if __name__ == "__main__":
    b = bodies(FAKE_MODEL)
    print("small:", len(b["small"][0]), "bytes")
    print("harness turn 1:", len(b["harness"][0]), "turn 30:", len(b["harness"][-1]), "bytes")
