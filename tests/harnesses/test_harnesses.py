"""Real harnesses end to end through the gateway, driven by the scripted policy engine.

The tests marked `harness` need the pinned CLIs installed (`make test-harnesses` does that into
~/.cache/openforgerl/harnesses, or $OPENFORGE_HARNESS_CACHE) and skip a harness that is missing. Each
runs the real CLI in a temp work directory with a private HOME pointed at one rollout, and checks
the file the policy wrote, the harness's success signal, and the branches of the recorded calls.
The unmarked tests check the policy kit and the adapters' config files without any CLI.
"""

from __future__ import annotations

import itertools
import json
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import openforgerl.gateway.server as gateway_server
from openforgerl.harnesses.adapters import HARNESSES, Harness, get, run
from openforgerl.harnesses.codex import Codex
from openforgerl.harnesses.pi import Pi
from openforgerl.rl.prompt_tools import example_value, json_schema_in, rendered_tools, shell_tool
from openforgerl.rollouts.trajectory import calls_from_json, token_stats
from openforgerl.testing.gateway import RunningGateway
from openforgerl.testing.policy_engine import ScriptedPolicyEngine
from tests.gateway_helpers import calls_of, new_rollout, running_gateway

MODEL = "openforge-policy"
TASK = "Write the text forge-ok into a file named result.txt in the current directory, then check it."
RUN_TIMEOUT = 180.0
# Harness prompts are large: 11-22 K tokens of the tiny model's tokenizer (Claude Code's system prompt
# and a dozen tools, Qwen Code's 14 tools); the scripted engine does not care how long they are.
MAX_CONTEXT = 131072


# -- a request log around the gateway app: the raw evidence when a harness fails ---------------------
@dataclass
class Exchange:
    kind: str  # "http" or "websocket"
    method: str
    path: str
    headers: dict[str, str]
    started: float
    body: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response: bytearray = field(default_factory=bytearray)
    frames: list[str] = field(default_factory=list)

    def describe(self, limit: int = 3000) -> str:
        lines = [f"{self.method} {self.path} -> {self.status} ({self.kind})", f"  headers: {self.headers}"]
        if self.body:
            lines.append(f"  body: {bytes(self.body[:limit]).decode(errors='replace')}")
        if self.response:
            lines.append(f"  response: {bytes(self.response[:limit]).decode(errors='replace')}")
        lines += [f"  frame: {frame[:limit]}" for frame in self.frames[:20]]
        return "\n".join(lines)


SECRET_HEADERS = {"authorization", "x-api-key", "x-goog-api-key"}


class RequestLog:
    """ASGI middleware keeping each request and (the head of) its answer, WebSocket frames included."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {
            k.decode(): ("<redacted>" if k.decode().lower() in SECRET_HEADERS else v.decode(errors="replace"))
            for k, v in scope["headers"]
        }
        query = scope.get("query_string", b"").decode()
        path = scope["path"] + (f"?{query}" if query else "")
        ex = Exchange(scope["type"], scope.get("method", "WS"), path, headers, time.time())
        self.exchanges.append(ex)

        async def logged_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                ex.body += message.get("body", b"")
            elif message["type"] == "websocket.receive":
                ex.frames.append("> " + (message.get("text") or repr(message.get("bytes"))))
            return message

        async def logged_send(message: Any) -> None:
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                ex.status = message["status"]
            elif message["type"] in ("http.response.body", "websocket.http.response.body"):
                if len(ex.response) < 20000:
                    ex.response += message.get("body", b"")
            elif message["type"] == "websocket.accept":
                ex.status = 101
            elif message["type"] == "websocket.send":
                ex.frames.append("< " + (message.get("text") or repr(message.get("bytes"))))
            await send(message)

        await self.app(scope, logged_receive, logged_send)

    def of(self, rollout_id: str) -> list[Exchange]:
        return [ex for ex in self.exchanges if f"/r/{rollout_id}/" in ex.path]


@dataclass
class Gateway:
    running: RunningGateway
    log: RequestLog
    dialects: set[str]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    logs: list[RequestLog] = []

    build_app = gateway_server.build_app

    def logged_build_app(cfg: Any, engine: Any = None) -> Any:
        app, gw = build_app(cfg, engine)
        logs.append(RequestLog(app))
        return logs[-1], gw

    engine = ScriptedPolicyEngine(tiny_model_dir)
    with pytest.MonkeyPatch.context() as mp:
        # The request log wraps the app that running_gateway serves (serve_in_thread builds it).
        mp.setattr(gateway_server, "build_app", logged_build_app)
        with running_gateway(
            tiny_model_dir, tmp_path_factory.mktemp("gateway"), engine=engine, max_context=MAX_CONTEXT
        ) as running:
            assert logs, "running_gateway no longer builds its app through gateway.server.build_app"
            yield Gateway(running, logs[0], {d.name for d in running.gateway.dialects})


# -- what the recorded calls say ---------------------------------------------------------------------
@dataclass
class Branches:
    calls: int
    branches: int
    extended: int  # calls that extended their branch's tip
    main_calls: list[dict[str, Any]]  # the conversation proper: calls that offered the model tools
    side: int  # calls without tools: titles, routers

    @property
    def share(self) -> float:
        return self.extended / self.calls if self.calls else 0.0

    @property
    def main_branches(self) -> int:
        return len({c["branch_id"] for c in self.main_calls})


def branches_of(calls: list[dict[str, Any]]) -> Branches:
    ok = [c for c in calls if c["status"] == "ok"]
    main = [c for c in ok if c["sampling_requested"].get("tools")]
    return Branches(
        calls=len(ok),
        branches=len({c["branch_id"] for c in ok}),
        extended=sum(1 for c in ok if c["parent_call_id"] is not None and not c["branch_reason"]),
        main_calls=main,
        side=len(ok) - len(main),
    )


def shell_commands(calls: list[dict[str, Any]]) -> list[str]:
    """The command lines the policy sent, in call order."""
    out = []
    for c in calls:
        for tc in c["response"].get("tool_calls") or []:
            args = tc["function"]["arguments"]
            args = json.loads(args) if isinstance(args, str) else args
            out += [str(args[k]) for k in ("command", "cmd") if k in args]
    return out


# -- the cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str  # a key of HARNESSES
    # Whether the main conversation's calls extend one branch. OpenClaw moves a trailing context
    # message to the end every turn, so each of its calls starts a branch.
    extends: bool = True


CASES = [
    Case("qwen-code"),
    Case("opencode"),
    Case("mini-swe-agent"),
    Case("openclaw", extends=False),
    Case("pi"),
    Case("claude-code"),
    Case("codex"),
    Case("gemini-cli"),
]


def usable(harness: Harness, gw: Gateway) -> None:
    found = harness.check()
    if not found.ok:
        pytest.skip(f"{harness.name}: {found.missing} (make test-harnesses installs it)")
    if harness.dialect not in gw.dialects:
        pytest.skip(f"the gateway has no {harness.dialect} dialect yet")


def fault_statuses(gw: Gateway, rollout_id: str) -> list[int]:
    return [ex.status for ex in gw.log.of(rollout_id) if ex.status is not None and ex.status >= 400]


def retry_delays(gw: Gateway, rollout_id: str) -> list[float]:
    """Seconds from each error answer's request to the harness's next request (errors answer at once)."""
    exchanges = gw.log.of(rollout_id)
    return [
        round(after.started - ex.started, 1)
        for ex, after in itertools.pairwise(exchanges)
        if ex.status is not None and ex.status >= 400
    ]


@dataclass
class Outcome:
    rollout_id: str
    stats: Branches
    env: dict[str, str]  # the harness's environment, for a resumed run in the same HOME and work dir


def drive(gw: Gateway, harness: Harness, tmp_path: Path, faults: list[int]) -> Outcome:
    """One task through one harness; asserts success, the file and the policy's steps."""
    rollout = new_rollout(gw.running, task_id=harness.name)
    rid = rollout["rollout_id"]
    if faults:
        r = httpx.post(
            f"{gw.running.url}/admin/rollouts/{rid}/faults",
            json={"errors": faults},
            headers=gw.running.admin_headers,
        )
        assert r.status_code == 200, r.text
    home, workdir = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    env = harness.prepare(home, workdir, rollout["base_url"], rollout["api_key"], MODEL)
    result = run(harness.command(TASK), cwd=workdir, env=env, timeout=RUN_TIMEOUT)
    calls = calls_of(gw.running, rid)
    stats = branches_of(calls)
    tokens = token_stats(calls_from_json({"calls": calls}))
    evidence = "\n".join(ex.describe() for ex in gw.log.of(rid)[-6:])
    context = (
        f"{harness.name}: exit {result.returncode} after {result.seconds:.1f}s\n"
        f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}\n"
        f"calls: {[(c['seq'], c['branch_id'], c['branch_reason'], c['status']) for c in calls]}\n"
        f"last requests:\n{evidence}"
    )
    print(
        f"\nHARNESS {harness.name} {harness.version} dialect={harness.dialect} faults={faults} "
        f"exit={result.returncode} seconds={result.seconds:.1f} calls={stats.calls} "
        f"branches={stats.branches} main_branches={stats.main_branches} "
        f"extended={stats.extended}/{stats.calls} ({stats.share:.0%}) side={stats.side} "
        f"http_errors={fault_statuses(gw, rid)} retry_delays_s={retry_delays(gw, rid)} "
        f"training_tokens merged={tokens.tokens_merged} per_call={tokens.tokens_per_call}"
    )
    assert not result.timed_out, context
    assert harness.succeeded(result, home), context
    # The policy only writes well-formed tool calls: a parse error means the gateway mangled one.
    assert not [c["parse_errors"] for c in calls if c["parse_errors"]], context
    assert (workdir / "result.txt").read_text() == "forge-ok", context
    commands = shell_commands([c for c in calls if c["status"] == "ok"])
    assert "printf 'forge-ok' > result.txt" in commands and "cat result.txt" in commands, context
    return Outcome(rid, stats, env)


@pytest.mark.harness
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_harness_completes_the_task(case: Case, gateway: Gateway, tmp_path: Path) -> None:
    harness = get(case.name)
    usable(harness, gateway)
    stats = drive(gateway, harness, tmp_path, faults=[]).stats
    if case.extends:
        # The write, the read and the final answer: one branch, each call extending the last.
        assert len(stats.main_calls) >= 3 and stats.main_branches == 1, stats
        assert all(c["parent_call_id"] is not None for c in stats.main_calls[1:]), stats
        assert all(c["branch_reason"] == "" for c in stats.main_calls[1:]), stats


@pytest.mark.harness
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_harness_survives_a_429_and_a_500(case: Case, gateway: Gateway, tmp_path: Path) -> None:
    harness = get(case.name)
    usable(harness, gateway)
    rid = drive(gateway, harness, tmp_path, faults=[429, 500]).rollout_id
    assert fault_statuses(gateway, rid)[:2] == [429, 500]


@pytest.mark.harness
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_harness_resumes_its_session(case: Case, gateway: Gateway, tmp_path: Path) -> None:
    harness = get(case.name)
    usable(harness, gateway)
    if not harness.can_resume:
        pytest.skip(f"{harness.name} cannot resume a session")
    first = drive(gateway, harness, tmp_path, faults=[])
    argv = harness.command("Check result.txt once more.", resume=True)
    result = run(argv, cwd=tmp_path / "work", env=first.env, timeout=RUN_TIMEOUT)
    calls = calls_of(gateway.running, first.rollout_id)
    new = [c for c in calls[first.stats.calls :] if c["status"] == "ok"]
    print(
        f"RESUME {harness.name} exit={result.returncode} seconds={result.seconds:.1f} calls={len(new)} "
        f"extending_the_first_run={sum(1 for c in new if c['branch_reason'] == '')} "
        f"branch_reasons={sorted({c['branch_reason'] for c in new if c['branch_reason']})}"
    )
    context = f"exit {result.returncode}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert harness.succeeded(result, tmp_path / "home"), context
    # The resumed history already holds both tool results, so the policy answers at once.
    assert new and any(c["response"].get("content", "").startswith("Done") for c in new), context


@pytest.mark.harness
def test_codex_over_websocket(gateway: Gateway, tmp_path: Path) -> None:
    harness = Codex(websocket=True)
    usable(harness, gateway)
    outcome = drive(gateway, harness, tmp_path, faults=[])
    rid, stats = outcome.rollout_id, outcome.stats
    exchanges = gateway.log.of(rid)
    sockets = [ex for ex in exchanges if ex.kind == "websocket"]
    evidence = "\n".join(ex.describe() for ex in exchanges)
    # The handshake carried the key (else 403 and a fall-back to HTTP), and every turn went over it.
    assert sockets and all(ex.status == 101 for ex in sockets), evidence
    assert not [ex for ex in exchanges if ex.kind == "http" and ex.path.endswith("/responses")], evidence
    sent = [f for ex in sockets for f in ex.frames if f.startswith("> ")]
    assert sum('"previous_response_id":"resp_' in f for f in sent) >= 2, evidence
    assert stats.main_branches == 1 and len(stats.main_calls) >= 3, stats


# -- the policy kit and the adapters, without any CLI --------------------------------------------------
def render(tiny_model_dir: Path, messages: list[dict[str, Any]], tools: list[Any]) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    return text


def tool(name: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": schema}}


def test_policy_finds_the_shell_tool_by_its_command_argument(tiny_model_dir: Path) -> None:
    tools = [
        tool("write_stdin", {"session_id": {"type": "integer"}, "chars": {"type": "string"}}, ["session_id"]),
        tool("Monitor", {"command": {"type": "string"}}, ["command"]),
        tool("Bash", {"command": {"type": "string"}, "description": {"type": "string"}}, ["command"]),
        tool("exec_command", {"cmd": {"type": "string"}, "why": {"type": "string"}}, ["cmd", "why"]),
    ]
    prompt = render(tiny_model_dir, [{"role": "user", "content": "go"}], tools)
    found = rendered_tools(prompt)
    assert [t["name"] for t in found] == ["write_stdin", "Monitor", "Bash", "exec_command"]
    shell = shell_tool(found)
    assert shell is not None and (shell.name, shell.command_arg) == ("Bash", "command")
    codex = shell_tool(found[3:])
    assert codex is not None
    call = json.loads(codex.call("ls").split("\n")[1])
    assert call == {"name": "exec_command", "arguments": {"cmd": "ls", "why": "scripted why"}}


def test_policy_plays_write_read_answer(tiny_model_dir: Path) -> None:
    engine = ScriptedPolicyEngine(tiny_model_dir)
    tools = [tool("bash", {"command": {"type": "string"}}, ["command"])]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    replies = []
    for _ in range(3):
        reply = engine.reply(render(tiny_model_dir, messages, tools))
        replies.append(reply)
        if "<tool_call>" in reply:
            call = json.loads(reply.split("\n")[1])
            messages.append({"role": "assistant", "content": "", "tool_calls": [{"function": call}]})
            messages.append({"role": "tool", "content": "ok"})
    assert "printf 'forge-ok' > result.txt" in replies[0]
    assert "cat result.txt" in replies[1]
    assert replies[2].startswith("Done")
    messages[1]["content"] = "Submit with echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT when done."
    assert "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in engine.reply(
        render(tiny_model_dir, messages, tools)
    )


def test_policy_answers_side_requests(tiny_model_dir: Path) -> None:
    engine = ScriptedPolicyEngine(tiny_model_dir)
    title = render(tiny_model_dir, [{"role": "system", "content": "You are a title generator."}], [])
    assert "<tool_call>" not in engine.reply(title)
    # Gemini CLI's router: the schema sits in its system instruction (types in capitals).
    schema = {
        "type": "OBJECT",
        "properties": {"complexity_reasoning": {"type": "STRING"}, "complexity_score": {"type": "INTEGER"}},
        "required": ["complexity_reasoning", "complexity_score"],
    }
    router = f'Respond *only* in JSON:\n```json\n{json.dumps(schema, indent=2)}\n```\nModel: {{"a": 1}}'
    answer = json.loads(engine.reply(render(tiny_model_dir, [{"role": "system", "content": router}], [])))
    assert answer == {"complexity_reasoning": "scripted complexity_reasoning", "complexity_score": 1}
    choice = {"type": "object", "properties": {"model_choice": {"type": "string", "enum": ["flash", "pro"]}}}
    assert example_value(choice) == {"model_choice": "flash"}
    assert json_schema_in('like this: { "reasoning": Your reasoning... }') is None


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_adapters_write_their_config_into_the_private_home(name: str, tmp_path: Path) -> None:
    harness = get(name, tmp_path / "cache")
    home, workdir = tmp_path / "home", tmp_path / "work"
    env = harness.prepare(home, workdir, "http://127.0.0.1:9/r/ro_1", "ofk-secret-key-0123456789", MODEL)
    assert env["HOME"] == str(home)
    assert "OPENAI_API_KEY" not in env or env["OPENAI_API_KEY"] == "ofk-secret-key-0123456789"
    written = [p for p in home.rglob("*") if p.is_file()]
    assert written, f"{name} wrote no config file"
    for path in written:
        text = path.read_text()
        if path.suffix == ".toml":
            tomllib.loads(text)
        elif path.suffix in (".json", ".yaml"):
            json.loads(text)
    argv = harness.command("do it")
    assert argv[0].startswith(str(tmp_path / "cache")) and "do it" in argv
    check = harness.check()
    assert not check.ok and check.missing


def test_codex_config_points_at_the_rollout(tmp_path: Path) -> None:
    env = Codex(tmp_path, websocket=True).prepare(tmp_path / "h", tmp_path, "http://gw/r/ro_1", "k", MODEL)
    config = tomllib.loads((tmp_path / "h" / ".codex" / "config.toml").read_text())
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://gw/r/ro_1/v1" and provider["wire_api"] == "responses"
    assert provider["supports_websockets"] is True and env[provider["env_key"]] == "k"
    assert config["model"] == MODEL and env["CODEX_HOME"] == str(tmp_path / "h" / ".codex")


def test_pi_speaks_each_dialect(tmp_path: Path) -> None:
    for api, dialect, suffix in [
        ("anthropic-messages", "anthropic", ""),
        ("google-generative-ai", "gemini", "/v1beta"),
        ("openai-responses", "openai-responses", "/v1"),
    ]:
        pi = Pi(tmp_path, api=api)
        pi.prepare(tmp_path / api, tmp_path, "http://gw/r/ro_1", "k", MODEL)
        models = json.loads((tmp_path / api / ".pi" / "agent" / "models.json").read_text())
        assert pi.dialect == dialect
        assert models["providers"]["openforge"]["baseUrl"] == "http://gw/r/ro_1" + suffix
    with pytest.raises(ValueError):
        Pi(tmp_path, api="smoke-signals")
