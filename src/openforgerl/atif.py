"""Trajectories in Harbor's Agent Trajectory Interchange Format (ATIF, Harbor's RFC 0001).

ATIF is what Harbor's viewer and trace tools (and NeMo Relay, which writes it too) load: one JSON
document per trajectory, `trajectory.json`, holding an ordered list of steps (system prompt, user
messages, agent turns with their tool calls and the observations that came back), per-step LLM
metrics and totals.

Export (`openforge export-atif`): each branch of a recorded rollout (the same branches export-sft
makes rows of) is one trajectory. An agent step is one recorded call: its answer, its model, and
its metrics with the gateway's exact token ids (the full prompt, the completion) and the completion's
logprobs in ATIF's own `prompt_token_ids`, `completion_token_ids` and `logprobs`; an upstream's
calls (text level) carry the upstream's token counts only. Assistant turns the harness sent but no
call generated (a resumed session, few-shot examples) are `is_copied_context` steps, which ATIF
says are not trained on. Tool results become the observation of the agent step whose call they
answer. Images are written beside the trajectory (images/<digest>.<ext>) and referenced by path, as
ATIF wants them. We write schema_version ATIF-v1.7: v1.8 only adds audio, which we never record,
and readers of v1.7 refuse a v1.8 label.

Import (`openforge sft --data`): ATIF trajectories from any agent become the chat rows SFT trains on
(`{"messages", "tools"}`), the agent's turns trained on unless copied context or not generated
(`llm_call_count: 0`).

The pydantic models below are our own reading of the RFC (v1.0 to v1.8 labels read, v1.7's fields,
no audio): field names, required fields and its checks (step ids 1, 2, ...; agent-only fields on
agent steps; an observation's `source_call_id` naming one of its step's tool calls; ISO 8601
timestamps). As Harbor's validator does, an unknown field is refused: custom data goes in `extra`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from openforgerl.gateway.export import CLOSED, ExportCounts, Selection, branch_paths, selected_rollouts
from openforgerl.images import Image, image_from_bytes
from openforgerl.store import RolloutRow, Store, public_calls

ATIF_VERSION: Final = "ATIF-v1.7"
TRAJECTORY_FILES = "trajectory*.json"  # Harbor's names: trajectory.json, trajectory.cont-1.json, ...

# -- the format --------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageSource(_Model):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    path: str  # relative to the trajectory file, absolute, or a URL


class ContentPart(_Model):
    type: Literal["text", "image"]
    text: str | None = None
    source: ImageSource | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ContentPart:
        if (self.type == "text") != (self.text is not None) or (self.type == "image") != (
            self.source is not None
        ):
            raise ValueError("a text part has `text` only, an image part `source` only")
        return self


class ToolCall(_Model):
    tool_call_id: str
    function_name: str
    arguments: dict[str, Any]
    extra: dict[str, Any] | None = None


class SubagentTrajectoryRef(_Model):
    trajectory_id: str | None = None
    session_id: str | None = None
    trajectory_path: str | None = None
    extra: dict[str, Any] | None = None


class ObservationResult(_Model):
    source_call_id: str | None = None  # the step's tool call this answers; None: not a tool call's
    content: str | list[ContentPart] | None = None
    subagent_trajectory_ref: list[SubagentTrajectoryRef] | None = None
    extra: dict[str, Any] | None = None


class Observation(_Model):
    results: list[ObservationResult]


class Metrics(_Model):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cost_usd: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    extra: dict[str, Any] | None = None


AGENT_ONLY = ("model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics")


class Step(_Model):
    step_id: int = Field(ge=1)
    timestamp: str | None = None
    source: Literal["system", "user", "agent"]
    model_name: str | None = None
    reasoning_effort: str | float | None = None
    message: str | list[ContentPart]
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    observation: Observation | None = None
    metrics: Metrics | None = None
    is_copied_context: bool | None = None
    llm_call_count: int | None = Field(default=None, ge=0)
    extra: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _rules(self) -> Step:
        if self.timestamp is not None:
            datetime.fromisoformat(self.timestamp.replace("Z", "+00:00"))  # ValueError names it
        if self.source != "agent":
            present = [f for f in AGENT_ONLY if getattr(self, f) is not None]
            if present:
                raise ValueError(f"{', '.join(present)}: only on agent steps (this is a {self.source} step)")
        elif self.llm_call_count == 0 and (self.metrics is not None or self.reasoning_content is not None):
            raise ValueError("an agent step with llm_call_count 0 (no LLM) has no metrics or reasoning")
        if self.observation is not None:
            ids = {c.tool_call_id for c in self.tool_calls or ()}
            for r in self.observation.results:
                if r.source_call_id is not None and r.source_call_id not in ids:
                    raise ValueError(
                        f"observation source_call_id {r.source_call_id!r} is no tool call of its step"
                    )
        return self


class Agent(_Model):
    name: str
    version: str
    model_name: str | None = None
    tool_definitions: list[dict[str, Any]] | None = None  # OpenAI function-calling schema
    extra: dict[str, Any] | None = None


class FinalMetrics(_Model):
    total_prompt_tokens: int | None = None
    total_completion_tokens: int | None = None
    total_cached_tokens: int | None = None
    total_cost_usd: float | None = None
    total_steps: int | None = Field(default=None, ge=0)
    extra: dict[str, Any] | None = None


class Trajectory(_Model):
    schema_version: Literal[
        "ATIF-v1.0",
        "ATIF-v1.1",
        "ATIF-v1.2",
        "ATIF-v1.3",
        "ATIF-v1.4",
        "ATIF-v1.5",
        "ATIF-v1.6",
        "ATIF-v1.7",
        "ATIF-v1.8",
    ] = ATIF_VERSION
    session_id: str | None = None  # the run's; shared by continuations and subagents
    trajectory_id: str | None = None  # this document's
    agent: Agent
    steps: list[Step] = Field(min_length=1)
    notes: str | None = None
    final_metrics: FinalMetrics | None = None
    continued_trajectory_ref: str | None = None
    extra: dict[str, Any] | None = None
    subagent_trajectories: list[Trajectory] | None = None

    @model_validator(mode="after")
    def _rules(self) -> Trajectory:
        for i, step in enumerate(self.steps, 1):
            if step.step_id != i:
                raise ValueError(f"steps[{i - 1}].step_id is {step.step_id}: step ids run 1, 2, 3, ...")
        subagent_ids = [t.trajectory_id for t in self.subagent_trajectories or ()]
        if None in subagent_ids or len(set(subagent_ids)) != len(subagent_ids):
            raise ValueError("each embedded subagent trajectory needs its own trajectory_id")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True, indent=2)


# -- export ------------------------------------------------------------------------------------

_EXTENSIONS = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp"}


def image_path(image: Image) -> str:
    """Where an exported trajectory's image lies, relative to the trajectory."""
    return f"images/{image.digest}.{_EXTENSIONS[image.media_type]}"


def _content(m: Mapping[str, Any], images: Mapping[str, Image]) -> str | list[dict[str, Any]]:
    """A recorded message's content: its text, or its images (files) before its text, as the
    gateway gave them to the model."""
    text = m.get("content") or ""
    if not isinstance(text, str):
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    digests = m.get("images") or []
    if not digests:
        return text
    parts: list[dict[str, Any]] = [
        {"type": "image", "source": {"media_type": images[d].media_type, "path": image_path(images[d])}}
        for d in digests
    ]
    return [*parts, {"type": "text", "text": text}] if text else parts


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    arguments = fn.get("arguments")
    out: dict[str, Any] = {
        "tool_call_id": call.get("id") or "",
        "function_name": fn.get("name") or "",
        "arguments": arguments if isinstance(arguments, dict) else {},
    }
    if isinstance(arguments, str) and arguments:
        # arguments that are not a JSON object (ATIF's must be one): kept verbatim, read back on import
        out["extra"] = {"arguments_text": arguments}
    return out


def _metrics(call: Mapping[str, Any], token_ids: bool) -> dict[str, Any]:
    if call["engine"].startswith("upstream:"):  # text level: the upstream's own counts, no ids
        usage = call["sampling_used"].get("usage") or {}
        return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens") if usage.get(k)}
    out: dict[str, Any] = {
        "prompt_tokens": call["prompt_tokens"],
        "completion_tokens": call["completion_tokens"],
    }
    if token_ids:
        out["prompt_token_ids"] = call["prompt_ids"]
        out["completion_token_ids"] = call["completion_ids"]
        if len(call["completion_logprobs"]) == len(call["completion_ids"]):
            out["logprobs"] = call["completion_logprobs"]
    # The prompt's leading ids that are the extended call's exact ids (the gateway's token memory),
    # not an engine's cache hits, which ATIF's cached_tokens counts.
    out["extra"] = {"reused_prompt_tokens": call["reused_prompt_tokens"]}
    return out


def _steps(
    path: Sequence[Mapping[str, Any]], images: Mapping[str, Image], token_ids: bool
) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []

    def add(m: Mapping[str, Any], call: Mapping[str, Any] | None) -> None:
        role = m.get("role")
        if role == "tool":  # the observation of the agent step whose call it answers
            last = steps[-1] if steps else None
            if last is None or last["source"] != "agent":
                last = {"source": "system", "message": ""}  # a tool result no agent turn asked for
                steps.append(last)
            result: dict[str, Any] = {"content": _content(m, images)}
            call_id = m.get("tool_call_id") or ""
            if call_id in {c["tool_call_id"] for c in last.get("tool_calls", ())}:
                result["source_call_id"] = call_id
            if m.get("name"):
                result["extra"] = {"name": m["name"]}
            last.setdefault("observation", {"results": []})["results"].append(result)
            return
        step: dict[str, Any] = {
            "source": {"system": "system", "assistant": "agent"}.get(str(role), "user"),
            "message": _content(m, images),
        }
        if role == "assistant":
            if m.get("reasoning_content"):
                step["reasoning_content"] = m["reasoning_content"]
            if m.get("tool_calls"):
                step["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
            if call is None:
                step["is_copied_context"] = True  # the harness wrote it; no call of the rollout did
            else:
                step["timestamp"] = datetime.fromtimestamp(call["created_at"], UTC).isoformat()
                step["model_name"] = call["model"]
                step["llm_call_count"] = 1
                step["metrics"] = _metrics(call, token_ids)
                step["extra"] = {k: call[k] for k in ("call_id", "engine", "finish_reason", "policy_version")}
        steps.append(step)

    for call in path:
        for m in call["messages_delta"]:
            add(m, None)
        add(call["response"], call)
    return [{"step_id": i, **s} for i, s in enumerate(steps, 1)]


def _version() -> str:
    try:
        return version("openforgerl")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown"


def trajectory(
    rollout: RolloutRow,
    path: Sequence[Mapping[str, Any]],
    images: Mapping[str, Image] | None = None,
    *,
    token_ids: bool = True,
) -> Trajectory:
    """One branch of a rollout (`branch_paths` of its calls in the public shape, with tokens) as an
    ATIF trajectory; `images`: those its messages show, by digest."""
    steps = _steps(path, images or {}, token_ids)
    metrics = [s["metrics"] for s in steps if "metrics" in s]
    totals = {
        f"total_{k}": sum(m.get(k, 0) for m in metrics)
        for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
        if any(k in m for m in metrics)
    }
    leaf = path[-1]
    agent: dict[str, Any] = {
        "name": "openforgerl",
        "version": _version(),
        "model_name": Counter(c["model"] for c in path).most_common(1)[0][0],
    }
    tools = path[0]["sampling_requested"].get("tool_definitions")
    if tools:
        agent["tool_definitions"] = tools
    return Trajectory.model_validate(
        {
            "schema_version": ATIF_VERSION,
            "session_id": rollout.id,
            "trajectory_id": f"{rollout.id}.branch-{leaf['branch_id']}",
            "agent": agent,
            "steps": steps,
            "final_metrics": {**totals, "total_steps": len(steps)},
            "extra": {
                "run_id": rollout.run_id,
                "task_id": rollout.task_id,
                "status": rollout.status,
                "reward": rollout.reward,
                "branch_id": leaf["branch_id"],
            },
        }
    )


def message_digests(path: Sequence[Mapping[str, Any]]) -> list[str]:
    return [d for c in path for m in (*c["messages_delta"], c["response"]) for d in m.get("images") or ()]


async def export_atif(
    store: Store, out: Path, selection: Selection = CLOSED, *, token_ids: bool = True
) -> ExportCounts:
    """Write each selected rollout's branches to `out/<rollout_id>/`: the first as trajectory.json,
    the others as trajectory.branch-<branch_id>.json, their images in images/. `counts.rows`
    counts trajectories."""
    counts = ExportCounts()
    async for r in selected_rollouts(store, counts, selection):
        paths = []
        for path in branch_paths(public_calls(await store.calls(r.id), tokens=token_ids)):
            if selection.include_side_requests or not path[-1]["side_request"]:
                paths.append(path)
            else:
                counts.skip("side request")
        folder = out / r.id
        for n, path in enumerate(sorted(paths, key=lambda p: p[-1]["branch_id"])):
            digests = set(message_digests(path))
            images = await store.images(digests)
            if len(images) < len(digests):  # cannot happen in a store the gateway wrote
                counts.skip("an image is missing from the store")
                continue
            for im in images.values():
                (folder / image_path(im)).parent.mkdir(parents=True, exist_ok=True)
                (folder / image_path(im)).write_bytes(im.data)
            name = "trajectory.json" if n == 0 else f"trajectory.branch-{path[-1]['branch_id']}.json"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(trajectory(r, path, images, token_ids=token_ids).to_json())
            counts.rows += 1
    return counts


# -- import ------------------------------------------------------------------------------------


def is_atif(path: Path) -> bool:
    """Whether SFT data at `path` is ATIF: a folder (of trajectory*.json files), or a file holding
    one JSON document with a schema_version (JSONL rows have none)."""
    if path.is_dir():
        return True
    try:
        doc = json.loads(path.read_bytes())
    except ValueError:  # JSONL: more than one document
        return False
    return isinstance(doc, dict) and "schema_version" in doc


def load_trajectory(path: Path) -> Trajectory:
    try:
        return Trajectory.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise ValueError(f"{path}: not an ATIF trajectory: {exc}") from None


def _image_url(source: ImageSource, base: Path) -> str:
    if "://" in source.path:
        raise ValueError(
            f"image {source.path}: images at URLs are not fetched; keep them beside the trajectory"
        )
    file = base / source.path  # an absolute path stays as it is
    try:
        return image_from_bytes(file.read_bytes()).data_url()
    except OSError as exc:
        raise ValueError(f"image {source.path}: {exc.strerror}") from None


def _chat_content(content: str | list[ContentPart] | None, base: Path) -> str | list[dict[str, Any]]:
    """ATIF content as a chat row's: text, or OpenAI parts with images as data URLs."""
    if content is None or isinstance(content, str):
        return content or ""
    if all(p.type == "text" for p in content):
        return "".join(p.text or "" for p in content)
    return [
        {"type": "text", "text": p.text}
        if p.source is None
        else {"type": "image_url", "image_url": {"url": _image_url(p.source, base)}}
        for p in content
    ]


def _tool_definition(tool: dict[str, Any]) -> dict[str, Any]:
    # The RFC says OpenAI's function-calling schema; both its wrapped and its bare form are met.
    return tool if "function" in tool else {"type": "function", "function": tool}


def chat_row(traj: Trajectory, base: Path) -> dict[str, Any]:
    """A trajectory as a chat row: system and user steps as such, agent steps as assistant turns
    (weight 0, untrained, when copied context or not generated by an LLM), each observation result as
    a tool message when it answers a tool call and as a user message when not (a terminal's output)."""
    messages: list[dict[str, Any]] = []
    for step in traj.steps:
        if step.source == "agent":
            m: dict[str, Any] = {"role": "assistant", "content": _chat_content(step.message, base)}
            if step.reasoning_content:
                m["reasoning_content"] = step.reasoning_content
            if step.tool_calls:
                m["tool_calls"] = [
                    {
                        "id": c.tool_call_id,
                        "type": "function",
                        "function": {
                            "name": c.function_name,
                            "arguments": (c.extra or {}).get("arguments_text", c.arguments),
                        },
                    }
                    for c in step.tool_calls
                ]
            if step.is_copied_context or step.llm_call_count == 0:
                m["weight"] = 0
            messages.append(m)
        elif step.message or step.observation is None:
            messages.append({"role": step.source, "content": _chat_content(step.message, base)})
        for r in step.observation.results if step.observation else ():
            content = _chat_content(r.content, base)
            if r.source_call_id is None:
                messages.append({"role": "user", "content": content})
                continue
            tool = {"role": "tool", "tool_call_id": r.source_call_id, "content": content}
            name = (r.extra or {}).get("name")
            if name:
                tool["name"] = name
            messages.append(tool)
    return {
        "messages": messages,
        "tools": [_tool_definition(t) for t in traj.agent.tool_definitions or ()],
        "rollout_id": traj.session_id or traj.trajectory_id or "",
    }


def atif_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file, chat row) for each trajectory at `path` (a trajectory file, or a folder searched for
    trajectory*.json), embedded subagent trajectories included."""
    files = sorted(path.rglob(TRAJECTORY_FILES)) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no {TRAJECTORY_FILES} files in it")
    for file in files:
        todo = [load_trajectory(file)]
        while todo:
            traj = todo.pop(0)
            try:
                yield str(file), chat_row(traj, file.parent)
            except ValueError as exc:
                raise ValueError(f"{file}: {exc}") from exc
            todo.extend(traj.subagent_trajectories or ())
