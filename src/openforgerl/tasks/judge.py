"""An LLM judge for web tasks (WebVoyager / WebJudge style): did the agent do what was asked?

The verifier `openforgerl.tasks.judge:judge` reads what the GUI harness left in the work directory
(`.openforge/gui/result.json`: `{"answer", "steps", "stopped", "url"}`, and the screenshots
`.openforge/gui/step-NNN.png`), shows a judge model the task, the agent's final answer and the last
K screenshots, and asks for a verdict: SUCCESS (reward 1) or NOT SUCCESS (reward 0).

The judge is asked through the gateway's upstream mode, never directly: the verifier opens a judge
rollout with `"upstream": NAME` on the gateway (started with e.g. `--upstream judge=openai:gpt-4.1`,
the key in the gateway's environment), sends one Chat Completions request to it with the `openai`
SDK (screenshots as data URLs), and closes it with the reward. So the judge's calls are recorded
like every other call (run `RUN-judge`, metadata `judges`: the scored rollout), and no key ever
reaches a verifier.

Where things come from:

- the gateway: the runner passes `gateway` (`tasks.verify.GatewayAccess`: URL, admin token, run,
  scored rollout); outside a runner, OPENFORGE_GATEWAY_URL and OPENFORGE_ADMIN_TOKEN;
- the upstream's name: the `upstream` argument, else $OPENFORGE_JUDGE_UPSTREAM, else `judge`.

What keeps the judge from being asked (no gateway, the gateway or the judge unreachable or refusing)
raises JudgeUnavailable: infrastructure, which the runner retries and never scores. A run it cannot
judge (no result.json, an answer without a verdict) raises JudgeError: a verifier error on what the
agent left, scored 0 (the reward's contract, docs/architecture.md), so no agent gains by making the
judge fail.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import openai

from openforgerl.images import Image, ImageError, image_from_bytes
from openforgerl.tasks.verify import GatewayAccess, VerifierUnavailable

GUI_DIR = ".openforge/gui"
RESULT_FILE = f"{GUI_DIR}/result.json"
DEFAULT_UPSTREAM = "judge"
SUCCESS, NOT_SUCCESS = "SUCCESS", "NOT SUCCESS"
_STEP = re.compile(r"step-(\d+)\.png")

SYSTEM_PROMPT = """\
You evaluate web-browsing agents. You get a task an agent was asked to do on a website, the \
agent's final answer (possibly empty) and screenshots of the browser from the end of its run, \
oldest first. Decide whether the agent accomplished the task.

- Judge by the screenshots and the answer only: do not assume actions or facts you cannot see.
- A task asking for information needs an answer that gives it and that the screenshots support; an \
answer the screenshots contradict is a failure.
- A task asking for something to be done (a search with filters, an item in a cart, a form) needs \
the screenshots to show it done with every condition of the task met (dates, prices, quantities, \
sorting, places).
- Doing part of the task is not success, and the agent saying it succeeded proves nothing.
- A reference answer marked golden is the right answer; one marked possible is one right answer \
among others.

Think briefly about what the task requires and what the evidence shows, then end with a last line \
that is exactly `Verdict: SUCCESS` or `Verdict: NOT SUCCESS`."""


class JudgeError(RuntimeError):
    """The judge could not judge what the agent left: a verifier error, scored 0."""


class JudgeUnavailable(JudgeError, VerifierUnavailable):
    """The judge could not be asked: infrastructure, retried and never scored."""


def read_result(workdir: Path) -> dict[str, Any]:
    """The GUI harness's result.json, checked to be a JSON object."""
    path = workdir / RESULT_FILE
    if not path.is_file():
        raise JudgeError(
            f"no {RESULT_FILE} in the work directory: the GUI harness left no result "
            "(was the task run with the 'gui' harness, and did it finish?)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JudgeError(f"{RESULT_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise JudgeError(f"{RESULT_FILE} must hold a JSON object, not {type(data).__name__}")
    return data


def last_screenshots(workdir: Path, k: int) -> list[Image]:
    """The last `k` step screenshots, oldest first (ordered by step number, not by name)."""
    folder = workdir / GUI_DIR
    steps = sorted(
        (int(m.group(1)), p)
        for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := _STEP.fullmatch(p.name)) and p.is_file()
    )
    images = []
    for _, path in steps[-k:] if k > 0 else []:
        try:
            images.append(image_from_bytes(path.read_bytes()))
        except ImageError as exc:
            raise JudgeError(f"screenshot {path.name} is not a usable image: {exc}") from exc
    return images


def judge_messages(
    task: str,
    result: dict[str, Any],
    screenshots: list[Image],
    reference: str | None = None,
    reference_type: str = "possible",
) -> list[dict[str, Any]]:
    """The judging request: a system prompt, then the screenshots followed by the case in text."""
    answer = result.get("answer")
    answer_text = str(answer).strip() if answer is not None else ""
    lines = [f"Task: {task}"]
    if reference:
        lines.append(f"Reference answer ({reference_type}): {reference}")
    lines.append(f"The agent's final answer: {answer_text or '(none: the agent gave no answer)'}")
    ended = f"The agent stopped after {result.get('steps', '?')} steps"
    if result.get("stopped"):
        ended += f" ({result['stopped']})"
    if result.get("url"):
        ended += f", on {result['url']}"
    lines.append(ended + ".")
    n = len(screenshots)
    lines.append(
        f"Above: the last {n} screenshot{'s' if n != 1 else ''} of the run, oldest first."
        if n
        else "There are no screenshots: judge by the answer alone."
    )
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": s.data_url()}} for s in screenshots
    ]
    parts.append({"type": "text", "text": "\n".join(lines)})
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": parts}]


_LABEL = re.compile(r"^\s*(?:final\s+)?(?:verdict|status|evaluation|result)\s*[:：=-]\s*(.*)$", re.I)
_NEGATIVE = re.compile(r"not\s*success|unsuccess", re.I)
_LAST_WORD = re.compile(r"NOT\s+SUCCESS|SUCCESS")


def _unmark(text: str) -> str:
    return re.sub(r"[*_`#\"'\[\]()<>]", " ", text)  # markdown emphasis, quotes, NOT_SUCCESS


def parse_verdict(text: str) -> str | None:
    """SUCCESS, NOT SUCCESS, or None when the text holds no verdict.

    The last labelled line (`Verdict: ...`, `Status: ...`, with or without markdown) decides; else
    the last SUCCESS / NOT SUCCESS written in capitals (as the prompt asks), so a reasoning line like
    "the search was not successful" is not taken for a verdict.
    """
    clean = _unmark(text)
    for line in reversed(clean.splitlines()):
        found = _LABEL.match(line)
        if not found:
            continue
        rest = found.group(1)
        if _NEGATIVE.search(rest):
            return NOT_SUCCESS
        if re.search(r"success", rest, re.I):
            return SUCCESS
        if re.search(r"fail", rest, re.I):
            return NOT_SUCCESS
    words = _LAST_WORD.findall(clean)
    if words:
        return NOT_SUCCESS if words[-1].startswith("NOT") else SUCCESS
    return None


def _reason(text: str, lines: int = 3, chars: int = 500) -> str:
    kept = [line.strip() for line in text.splitlines() if line.strip() and not _LABEL.match(_unmark(line))]
    return "\n".join(kept[:lines])[:chars]


def _admin(access: GatewayAccess, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        r = httpx.request(
            method,
            access.url.rstrip("/") + path,
            json=body,
            headers={"authorization": f"Bearer {access.admin_token}"},
            timeout=60,
        )
    except httpx.HTTPError as exc:
        raise JudgeUnavailable(f"cannot reach the gateway's admin API at {access.url}: {exc!r}") from exc
    if r.status_code >= 300:
        try:
            text = str(r.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            text = r.text[:500]
        raise JudgeUnavailable(f"the gateway refused {method} {path} ({r.status_code}): {text}")
    data: dict[str, Any] = r.json()
    return data


def _ask(access: GatewayAccess, rollout: dict[str, Any], messages: Any, name: str, **create: Any) -> str:
    base_url = f"{access.url.rstrip('/')}/r/{rollout['rollout_id']}/v1"
    client = openai.OpenAI(
        base_url=base_url, api_key=rollout["api_key"], max_retries=2, timeout=create.pop("timeout")
    )
    try:
        reply = client.chat.completions.create(model=name, messages=messages, **create)
    except openai.APIStatusError as exc:
        raise JudgeUnavailable(
            f"the judge (upstream {name!r}) failed with {exc.status_code}: {exc.message}"
        ) from exc
    except openai.APIError as exc:
        raise JudgeUnavailable(
            f"the judge (upstream {name!r}) cannot be reached through {access.url}: {exc}"
        ) from exc
    finally:
        client.close()
    content = reply.choices[0].message.content if reply.choices else None
    if not content:
        raise JudgeError(f"the judge (upstream {name!r}) answered with no text")
    return content


def judge(
    workdir: Path,
    *,
    task: str,
    reference: str | None = None,
    reference_type: str = "possible",
    screenshots: int = 3,
    upstream: str | None = None,
    max_tokens: int = 1024,
    temperature: float | None = 0.0,
    timeout: float = 300.0,
    gateway: GatewayAccess | None = None,
) -> dict[str, Any]:
    """Judge the GUI harness's run in `workdir`: {"reward", "verdict", "judge_rollout", "reason", ...}.

    `screenshots`: how many of the last screenshots the judge sees (0: the answer alone).
    `temperature`: None leaves it to the judge model (reasoning models accept only their default).
    """
    if screenshots < 0:
        raise JudgeUnavailable(f"screenshots must be >= 0, not {screenshots}")
    access = gateway or GatewayAccess.from_env()
    if access is None:
        raise JudgeUnavailable(
            "the judge needs the gateway: run it through the runner (openforge eval), or set "
            "OPENFORGE_GATEWAY_URL and OPENFORGE_ADMIN_TOKEN"
        )
    result = read_result(Path(workdir))
    shots = last_screenshots(Path(workdir), screenshots)
    messages = judge_messages(task, result, shots, reference, reference_type)
    name = upstream or os.environ.get("OPENFORGE_JUDGE_UPSTREAM") or DEFAULT_UPSTREAM
    rollout = _admin(
        access,
        "POST",
        "/admin/rollouts",
        {
            "run_id": f"{access.run_id}-judge" if access.run_id else "judge",
            "task_id": access.task_id,
            "upstream": name,
            "metadata": {"judges": access.rollout_id} if access.rollout_id else {},
        },
    )
    close = f"/admin/rollouts/{rollout['rollout_id']}/close"
    create: dict[str, Any] = {"max_tokens": max_tokens, "timeout": timeout}
    if temperature is not None:
        create["temperature"] = temperature
    try:
        text = _ask(access, rollout, messages, name, **create)
        verdict = parse_verdict(text)
        if verdict is None:
            raise JudgeError(f"the judge's answer holds no verdict (SUCCESS / NOT SUCCESS): {text[-500:]!r}")
    except JudgeError as exc:
        try:
            _admin(access, "POST", close, {"status": "failed", "details": {"error": str(exc)[:1000]}})
        except JudgeError:
            pass  # the first error is the one to report
        raise
    reward = 1.0 if verdict == SUCCESS else 0.0
    _admin(access, "POST", close, {"reward": reward, "details": {"verdict": verdict}, "status": "closed"})
    return {
        "reward": reward,
        "verdict": verdict,
        "judge_rollout": rollout["rollout_id"],
        "reason": _reason(text),
        "screenshots": len(shots),
        "answer": result.get("answer"),
    }
