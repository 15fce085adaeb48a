"""Recorded rollouts -> chat rows for SFT (`openforge export-sft`).

Each branch of a rollout becomes one row, `{"messages": [...], "tools": [...]}` plus where it came
from: the messages the harness sent along the branch, with each answer as it was recorded (not as
the harness echoed it back), and the tool definitions the branch was given. `openforge sft --data`
tokenises such rows with the student's chat template and trains on the assistant turns. It works
for any rollout, answered by the policy or by an upstream (a teacher), since every call records its
messages; it is what makes an upstream's text-level trajectories trainable.

Assistant turns the harness sent but no call of the rollout generated (a resumed session's history,
few-shot examples) carry `"weight": 0`, the OpenAI fine-tuning convention for "do not train on this
turn". Branches that are side requests (titles, routers), that hold an answer cut by max_tokens, or
whose tool definitions were not recorded (calls recorded before the gateway kept them) are left out
and counted.

Images are written into the row, as OpenAI content parts with data URLs (images first, then the
text: the order they had in the prompt), so a row is self-contained: it trains without the store.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openforgerl.images import Image
from openforgerl.store import CallRow, RolloutRow, Store, public_calls


@dataclass(slots=True)
class ExportCounts:
    rollouts: int = 0  # rollouts that passed the filters
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # branches left out, by reason

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _sent(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the harness sent them; its assistant turns are not this rollout's answers."""
    return [{**m, "weight": 0} if m.get("role") == "assistant" else dict(m) for m in messages]


def branch_paths(calls: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A rollout's branches, one per ok call that no other ok call extends: the ok calls from the
    branch's first call to that one, in order (calls in the public shape, in seq order). A branch's
    conversation is each call's `messages_delta` followed by its `response`, call after call."""
    paths: dict[int, list[dict[str, Any]]] = {}
    extended: set[int] = set()
    ok = [c for c in calls if c["status"] == "ok" and c["call_id"] is not None]
    for c in ok:
        parent_id = c["parent_call_id"]
        if parent_id is None:
            paths[c["call_id"]] = [c]
        elif parent_id in paths:
            extended.add(parent_id)
            paths[c["call_id"]] = [*paths[parent_id], c]
        # else: it extends a call that is not here, which cannot happen in a store the gateway wrote
    return [paths[c["call_id"]] for c in ok if c["call_id"] in paths and c["call_id"] not in extended]


def chat_rows(
    rollout: RolloutRow,
    calls: Sequence[CallRow],
    counts: ExportCounts,
    *,
    include_side_requests: bool = False,
) -> list[dict[str, Any]]:
    """One chat row per branch of the rollout (calls in seq order, as the store returns them), read
    in the public shape of a recorded call (`public_calls`, as the admin API gives them)."""
    rows = []
    for path in branch_paths(public_calls(calls, tokens=False)):
        leaf, requested = path[-1], path[0]["sampling_requested"]
        # None: the branch had tools whose definitions were not recorded
        tools = requested.get("tool_definitions")
        if tools is None and not requested.get("tools"):
            tools = []
        if not include_side_requests and leaf["side_request"]:
            counts.skip("side request")
        elif any(c["finish_reason"] == "length" for c in path):
            counts.skip("an answer was cut by max_tokens")
        elif tools is None:
            counts.skip("tool definitions not recorded")
        else:
            messages = [m for c in path for m in (*_sent(c["messages_delta"]), dict(c["response"]))]
            rows.append(
                {
                    "messages": messages,
                    "tools": tools,
                    "rollout_id": rollout.id,
                    "run_id": rollout.run_id,
                    "task_id": rollout.task_id,
                    "reward": rollout.reward,
                    "branch_id": leaf["branch_id"],
                    "call_ids": [c["call_id"] for c in path],
                    "models": sorted({c["model"] for c in path}),
                    "engines": sorted({c["engine"] for c in path}),
                }
            )
    return rows


def row_digests(row: dict[str, Any]) -> list[str]:
    """The digests of the images a chat row's messages show (as `chat_rows` leaves them)."""
    return [d for m in row["messages"] for d in m.get("images") or ()]


def inline_images(row: dict[str, Any], images: Mapping[str, Image]) -> dict[str, Any] | None:
    """The row with each message's images (digests) as OpenAI image_url parts before its text; None
    when an image is not among `images`."""
    if any(d not in images for d in row_digests(row)):
        return None
    messages = []
    for m in row["messages"]:
        digests = m.get("images")
        if not digests:
            messages.append(m)
            continue
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": images[d].data_url()}} for d in digests
        ]
        if m.get("content"):
            parts.append({"type": "text", "text": m["content"]})
        messages.append({**{k: v for k, v in m.items() if k != "images"}, "content": parts})
    return {**row, "messages": messages}


@dataclass(frozen=True, slots=True)
class Selection:
    """Which recorded rollouts, and which of their branches, an export writes (the options that
    `openforge export-sft` and `export-atif` share)."""

    run_id: str | None = None  # only this run's
    min_reward: float | None = None  # only rollouts rewarded at least this
    statuses: Sequence[str] = ("closed",)  # none: every status
    include_side_requests: bool = False  # titles, routers and other side calls too

    def takes(self, r: RolloutRow) -> bool:
        if self.statuses and r.status not in self.statuses:
            return False
        return self.min_reward is None or (r.reward is not None and r.reward >= self.min_reward)


CLOSED = Selection()  # an export's default: every closed rollout, side requests left out


async def selected_rollouts(
    store: Store, counts: ExportCounts, selection: Selection
) -> AsyncIterator[RolloutRow]:
    """The store's rollouts that `selection` takes, page by page, each counted."""
    offset, page = 0, 500
    while True:
        rollouts = await store.list_rollouts(run_id=selection.run_id, limit=page, offset=offset)
        offset += len(rollouts)
        for r in rollouts:
            if selection.takes(r):
                counts.rollouts += 1
                yield r
        if len(rollouts) < page:
            return


async def export_sft(store: Store, out: Path, selection: Selection = CLOSED) -> ExportCounts:
    """Write the chat rows of the rollouts `selection` takes to `out` (JSONL)."""
    counts = ExportCounts()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        async for r in selected_rollouts(store, counts, selection):
            for row in chat_rows(
                r, await store.calls(r.id), counts, include_side_requests=selection.include_side_requests
            ):
                digests = row_digests(row)
                if digests:
                    inlined = inline_images(row, await store.images(digests))
                    if inlined is None:  # cannot happen in a store the gateway wrote
                        counts.skip("an image is missing from the store")
                        continue
                    row = inlined
                f.write(json.dumps(row, ensure_ascii=False))
                f.write("\n")
                counts.rows += 1
    return counts
