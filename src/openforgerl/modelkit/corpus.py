"""Offline training text for the tiny model kit: standard-library sources and synthetic agent chats.

Everything here is a pure function of the Python version and fixed seeds, so the tokenizer trained on
it is reproducible.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

# Enough text for 8k-16k merges while keeping tokenizer training to a few seconds.
STDLIB_BUDGET_BYTES = 2_500_000

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t, "description": d} for p, t, d in params},
                "required": [params[0][0]],
            },
        },
    }
    for name, description, params in [
        ("get_weather", "Get the current weather in a city.", [("city", "string", "City name")]),
        (
            "search_web",
            "Search the web and return the top results.",
            [("query", "string", "Search query"), ("max_results", "integer", "How many results")],
        ),
        ("read_file", "Read a text file from the workspace.", [("path", "string", "File path")]),
        (
            "write_file",
            "Write text to a file in the workspace.",
            [("path", "string", "File path"), ("content", "string", "New file content")],
        ),
        (
            "run_shell",
            "Run a shell command and return its output.",
            [("command", "string", "Command line"), ("timeout", "number", "Seconds before it is killed")],
        ),
        ("python", "Execute Python code and return stdout.", [("code", "string", "Python source")]),
        ("list_dir", "List the entries of a directory.", [("path", "string", "Directory path")]),
        ("calculator", "Evaluate an arithmetic expression.", [("expression", "string", "Expression")]),
        (
            "http_get",
            "Fetch a URL over HTTP.",
            [("url", "string", "Absolute URL"), ("headers", "object", "Extra headers")],
        ),
        ("get_time", "Current time in a time zone.", [("timezone", "string", "IANA time zone")]),
        (
            "lookup_user",
            "Look up a user record by id.",
            [("user_id", "integer", "User id"), ("fields", "array", "Fields to return")],
        ),
    ]
]

_CITIES = ["Paris", "Tokyo", "Berlin", "Lagos", "Lima", "Oslo", "Seoul", "Austin", "Cairo", "Hanoi"]
_OPENERS = [
    "Can you",
    "Please",
    "Could you",
    "I need you to",
    "Help me",
    "Quickly",
    "Would you mind if you",
    "Go ahead and",
]
_THOUGHTS = [
    "The user wants {w}. I should call {tool} first and then summarise the result.",
    "Let me think step by step. First I check {w}, then I answer.",
    "I need more information about {w}, so a tool call is the right move.",
    "This is simple: {w} can be answered directly.",
    "Hmm, {w} looks ambiguous. I will pick the most likely meaning.",
]
_ANSWER_THOUGHTS = [
    "The tool output covers {w}; I can answer now.",
    "Nothing else is needed for {w}. Keep the answer short.",
    "Let me double-check {w} before answering.",
]
_ANSWERS = [
    "Done. The result is {n}.",
    "Here is what I found: {w}.",
    "The {w} is ready; the total is {n}.",
    "I could not find {w}, sorry.",
    "Sure! {w} — {n} items in total.",
    "The answer is {n}.",
]


def stdlib_text(budget: int = STDLIB_BUDGET_BYTES) -> Iterator[str]:
    """Yield the listed standard-library files, in list order, until `budget` bytes are used."""
    listing = resources.files(__package__).joinpath("stdlib_files.txt").read_text(encoding="utf-8")
    root = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for rel in listing.splitlines():
        if not rel or rel.startswith("#"):
            continue
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if used + len(text) > budget:
            text = text[: budget - used]
        used += len(text)
        yield text
        if used >= budget:
            return


def _words(rng: random.Random, vocab: list[str], k: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(k))


def _arguments(rng: random.Random, tool: dict[str, Any], vocab: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for name, spec in tool["function"]["parameters"]["properties"].items():
        if name not in tool["function"]["parameters"]["required"] and rng.random() < 0.5:
            continue
        kind = spec["type"]
        if name == "city":
            args[name] = rng.choice(_CITIES)
        elif name in ("path", "url"):
            parts = [rng.choice(vocab) for _ in range(rng.randint(1, 3))]
            args[name] = ("https://example.com/" if name == "url" else "src/") + "/".join(parts) + ".py"
        elif kind == "integer":
            args[name] = rng.randint(0, 2000)
        elif kind == "number":
            args[name] = round(rng.uniform(0, 100), 1)
        elif kind == "array":
            args[name] = [rng.choice(vocab) for _ in range(rng.randint(1, 3))]
        elif kind == "object":
            args[name] = {rng.choice(vocab): rng.choice(vocab)}
        elif name == "code":
            args[name] = f"print({rng.choice(vocab)}({rng.randint(1, 99)}))"
        else:
            args[name] = _words(rng, vocab, rng.randint(1, 6))
    return args


def _tool_result(rng: random.Random, vocab: list[str]) -> str:
    result: dict[str, Any] = {
        "ok": rng.random() < 0.9,
        rng.choice(vocab): rng.randint(-50, 5000),
        rng.choice(vocab): _words(rng, vocab, rng.randint(1, 5)),
    }
    if rng.random() < 0.3:
        result["items"] = [{"id": i, "name": rng.choice(vocab)} for i in range(rng.randint(1, 3))]
    return json.dumps(result, ensure_ascii=False)


def synthetic_conversation(rng: random.Random, vocab: list[str]) -> dict[str, Any]:
    """One agent-style conversation: {"messages": [...], "tools": [...] or None}."""
    tools = rng.sample(TOOLS, rng.randint(1, 4)) if rng.random() < 0.7 else None
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": f"You are a {rng.choice(vocab)} assistant. Be brief."})
    for _turn in range(rng.randint(1, 3)):
        topic = _words(rng, vocab, rng.randint(2, 5))
        messages.append({"role": "user", "content": f"{rng.choice(_OPENERS)} {topic}?"})
        if tools and rng.random() < 0.7:
            calls: list[dict[str, Any]] = []
            for i in range(rng.randint(1, 2)):
                tool = rng.choice(tools)
                calls.append(
                    {
                        "id": f"call_{rng.randint(0, 10**8)}_{i}",
                        "type": "function",
                        "function": {
                            "name": tool["function"]["name"],
                            "arguments": _arguments(rng, tool, vocab),
                        },
                    }
                )
            thought = rng.choice(_THOUGHTS).format(w=topic, tool=calls[0]["function"]["name"])
            call_turn: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": calls}
            if rng.random() < 0.6:
                call_turn["reasoning_content"] = thought
            messages.append(call_turn)
            for call in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": _tool_result(rng, vocab)}
                )
        answer: dict[str, Any] = {
            "role": "assistant",
            "content": rng.choice(_ANSWERS).format(w=topic, n=rng.randint(0, 999)),
        }
        if rng.random() < 0.4:
            answer["reasoning_content"] = rng.choice(_ANSWER_THOUGHTS).format(w=topic)
        messages.append(answer)
    return {"messages": messages, "tools": tools}


def word_list(text: str, limit: int = 3000) -> list[str]:
    """The `limit` most frequent words of `text` (ties broken alphabetically), for synthetic chats."""
    counts: dict[str, int] = {}
    for word in re.findall(r"[A-Za-z][a-z]{2,11}", text):
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))[:limit]


def synthetic_conversations(n: int, vocab: list[str], seed: int = 1234) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [synthetic_conversation(rng, vocab) for _ in range(n)]
