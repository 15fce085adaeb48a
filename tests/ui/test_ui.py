"""`openforge view`: the JSON API on its own (bad parameters, paging at 100,000 rollouts by query plan,
the token guard), and the front end in Debian's Chromium driven by Playwright (marker `ui`).

The run the tests open is real: a gateway records a scripted policy's calls (OpenAI and Anthropic
dialects, tool calls, a side request, a rewritten history), and the run folder holds what a
trainer writes (metrics.jsonl, config.json, eval reports, token_logprobs.jsonl) and a runner.db.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from openai import OpenAI
from starlette.testclient import TestClient

from openforgerl.behaviour import main_conversation, of_conversation
from openforgerl.cli import main as cli
from openforgerl.gateway.server import GatewayConfig
from openforgerl.rollouts.results import RolloutResult, RunState, Status
from openforgerl.rollouts.trajectory import calls_from_json
from openforgerl.store.sqlite import SCHEMA, ids_to_blob
from openforgerl.store.view import SORTS, VIEWER_INDEXES, Filters, StoreView, page_query
from openforgerl.testing.gateway import gateway_thread
from openforgerl.ui import ViewerConfig, build_app
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout
from tests.ui_helpers import serve_viewer, shot

RUN = "train-demo"
STEPS = 12
TOOL_CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
READ_FILE: Any = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
BASH: Any = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


# -- the recorded run ----------------------------------------------------------------------------
def _close(url: str, headers: dict[str, str], rollout_id: str, **body: Any) -> None:
    r = httpx.post(f"{url}/admin/rollouts/{rollout_id}/close", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def _anthropic(rollout: dict[str, Any], body: Any) -> None:
    headers = {"x-api-key": rollout["api_key"], "anthropic-version": "2023-06-01"}
    r = httpx.post(rollout["base_url"] + "/v1/messages", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def record_rollouts(model_dir: Path, store: Path) -> dict[str, str]:
    """Rollouts through a real gateway and a scripted policy; returns their ids by role."""
    replies: list[str] = []
    engine = ScriptEngine(model_dir, lambda prompt: replies.pop(0))
    cfg = GatewayConfig(model=str(model_dir), store=str(store), port=0, max_tokens=96)
    ids: dict[str, str] = {}
    with gateway_thread(cfg, engine) as gw:
        url, admin = gw.url, gw.admin_headers

        # OpenAI dialect: a tool call, its result, the answer; then a title side request.
        ro = new_rollout(gw, run_id=RUN, task_id="notes-summary", metadata={"harness": "react"})
        ids["tools"] = ro["rollout_id"]
        client = OpenAI(base_url=ro["base_url"] + "/v1", api_key=ro["api_key"], max_retries=0, timeout=60)
        replies += [
            "I will read the file first.\n"
            + TOOL_CALL.format(name="read_file", args='{"path": "notes.txt"}'),
            "notes.txt says: buy milk and eggs.",
            '{"title": "Shopping notes"}',
        ]
        history: list[Any] = [
            {"role": "system", "content": "You are a coding agent. Use the tools when useful."},
            {"role": "user", "content": "What does notes.txt say? Answer in one line."},
        ]
        first = client.chat.completions.create(model="gpt-4o", messages=history, tools=[READ_FILE])
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        history += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "buy milk and eggs"},
        ]
        client.chat.completions.create(model="gpt-4o", messages=history, tools=[READ_FILE])
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "A three-word title for this chat, as JSON."}],
            response_format={"type": "json_object"},
        )
        verdict = {"outcome": "ok", "checks": {"mentions milk": True, "one line": True}}
        # As the runner does at close: how the rollout acted, read from its recorded conversation.
        recorded = calls_from_json({"calls": calls_of(gw, ids["tools"])})
        verdict["behaviour"] = of_conversation(main_conversation(recorded))
        _close(url, admin, ids["tools"], reward=1.0, details=verdict)

        # Anthropic dialect: a Bash tool turn, then the harness rewrites the history (a new branch).
        ro = new_rollout(gw, run_id=RUN, task_id="list-files", metadata={"harness": "claude-code"})
        ids["branch"] = ro["rollout_id"]
        replies += [
            TOOL_CALL.format(name="Bash", args='{"command": "ls"}'),
            "There are two files: a.txt and b.txt.",
            "a.txt, b.txt",
        ]
        ask: Any = {
            "model": "claude-sonnet",
            "max_tokens": 64,
            "system": "You are Claude Code.",
            "tools": [BASH],
        }
        turns: list[Any] = [{"role": "user", "content": "List the files."}]
        _anthropic(ro, {**ask, "messages": turns})
        turns += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "tu_1", "name": "Bash", "input": {"command": "ls"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "a.txt\nb.txt"}],
            },
        ]
        _anthropic(ro, {**ask, "messages": turns})
        _anthropic(ro, {**ask, "messages": [{"role": "user", "content": "List the files, briefly."}]})
        _close(url, admin, ids["branch"], reward=0.0, details={"outcome": "timeout"}, status="failed")

        # A handful of one-call rollouts with spread rewards, and one still open.
        for i, reward in enumerate([0.25, 0.5, 0.75, 1.0]):
            ro = new_rollout(gw, run_id=RUN, task_id=f"arith-{i}", metadata={"harness": "react"})
            replies.append(f"The answer is {i + 2}.")
            OpenAI(
                base_url=ro["base_url"] + "/v1", api_key=ro["api_key"], max_retries=0
            ).chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": f"What is {i} + 2?"}]
            )
            _close(url, admin, ro["rollout_id"], reward=reward, details={"outcome": "ok"})
        ids["open"] = new_rollout(gw, run_id=RUN, task_id="still-running")["rollout_id"]
    return ids


def write_trainer_files(folder: Path, model_dir: Path, ids: dict[str, str], store: Path) -> None:
    """What a trainer and the runner leave in the run folder."""
    rows = []
    for step in range(1, STEPS + 1):
        rows.append(
            {
                "step": step,
                "reward_mean": round(0.2 + 0.05 * step, 3),
                "pass_rate": round(0.1 + 0.05 * step, 3),
                "loss": round(1.0 / step, 4),
                "kl": round(0.001 * step, 4),
                "clip_fraction": 0.02,
                "tokens_per_s": 1000 + 10 * step,
                "time_rollout": 4.0,
                "time_train": 2.5,
                "behaviour/recovery_rate": round(0.05 * step, 3),  # the loop's names (rl/loop.py)
                "behaviour/gave_up_rate": round(1 - 0.05 * step, 3),
                "note": "not a number: ignored",
            }
        )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(
        json.dumps({"model_dir": str(model_dir), "algorithm": "grpo", "lr": 1e-6})
    )

    def report(mean: float, pass1: float) -> dict[str, Any]:
        def iv(v: float) -> dict[str, float]:
            return {"estimate": v, "low": max(0.0, v - 0.1), "high": min(1.0, v + 0.1)}

        return {
            "tasks": "tools-tiny",
            "harness": "react",
            "k": 2,
            "n": 2,
            "rollouts": 20,
            "scored": 20,
            "outcomes": {"ok": 18, "timeout": 2},
            "summary": {
                "mean_reward": iv(mean),
                "pass@k": {"1": iv(pass1), "2": iv(pass1 + 0.1)},
                "pass^k": {"1": iv(pass1), "2": iv(pass1 - 0.1)},
            },
            "tokens": {"prompt": 12000, "completion": 3000},
            "seconds": 42.0,
        }

    for name, mean, pass1 in [("before-sft", 0.2, 0.15), ("after-sft", 0.45, 0.4), ("after-rl", 0.7, 0.65)]:
        (folder / f"eval-{name}").mkdir()
        (folder / f"eval-{name}" / "report.json").write_text(json.dumps(report(mean, pass1)))
        time.sleep(0.01)  # distinct mtimes: unlisted evals show oldest first
    state = RunState(folder / "runner.db")
    result = RolloutResult("notes-summary", 0, Status.DONE, 1.0, "ok", ids["tools"], 1)
    result.details = {
        "verifier": {"passed": ["mentions milk"], "failed": []},
        "harness": {"exit_code": 0, "tail": "done\n"},
    }
    result.seconds = {"start": 0.4, "harness": 3.2, "verify": 0.3, "total": 4.0}
    state.save(result)
    state.close()
    with contextlib.closing(StoreView(store)) as view:
        found = view.rollout(ids["tools"])
    assert found is not None
    first_call = found[1][0].id
    n = found[1][0].prompt_tokens + len(found[1][0].completion_ids) + 40
    line = {
        "step": STEPS,
        "rollout_id": ids["tools"],
        "call_id": first_call,
        "trainer_logprobs": [-0.4] * n,
        "importance_weights": [1.01] * n,
    }
    (folder / "token_logprobs.jsonl").write_text(json.dumps(line) + "\n")


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("runs")
    folder = root / RUN
    folder.mkdir()
    ids = record_rollouts(tiny_model_dir, folder / "gateway.db")
    write_trainer_files(folder, tiny_model_dir, ids, folder / "gateway.db")
    return root, ids


@pytest.fixture(scope="module")
def api(run_dir: tuple[Path, dict[str, str]]) -> Iterator[TestClient]:
    with TestClient(build_app(ViewerConfig(runs=run_dir[0])), base_url="http://127.0.0.1") as client:
        yield client


# -- the API ------------------------------------------------------------------------------------
def error_of(r: Any, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    message: str = r.json()["error"]["message"]
    return message


@pytest.mark.parametrize(
    ("params", "status", "says"),
    [
        ({"page_size": "0"}, 400, "'page_size' must be an integer from 1 to 500"),
        ({"page_size": "501"}, 400, "'page_size' must be an integer from 1 to 500"),
        ({"page_size": "ten"}, 400, "got 'ten'"),
        ({"page": "0"}, 400, "'page' must be an integer from 1 to"),
        ({"sort": "bogus"}, 400, "unknown sort key 'bogus'"),
        ({"sort": "-secret"}, 400, "one of created, task"),
        ({"min_reward": "high"}, 400, "'min_reward' must be a finite number"),
        ({"run": "nope"}, 404, "no run named 'nope'"),
        ({"run": None}, 400, "'run' parameter is required"),
    ],
)
def test_rollouts_api_rejects_bad_parameters(
    api: TestClient, params: dict[str, Any], status: int, says: str
) -> None:
    query = {k: v for k, v in {"run": RUN, **params}.items() if v is not None}
    assert says in error_of(api.get("/api/rollouts", params=query), status)


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/api/rollouts", "page"),
        ("/api/rollouts", "page_size"),
        ("/api/rollouts", "min_reward"),
        ("/api/rollouts", "max_reward"),
        ("/api/metrics", "after"),
    ],
)
def test_every_numeric_query_value_out_of_range_or_not_a_number_is_a_json_400_naming_it(
    api: TestClient, path: str, name: str
) -> None:
    """Found by a probe: `page=9223372036854775807` overflowed SQLite's OFFSET, a plain-text 500."""
    integer = name.startswith("page")
    bad = ["x", "1e999", "nan", "-inf", "\u0661", "9" * 5000]
    bad += ["9223372036854775807", "-1", "1.5"] if integer else []
    for value in bad:
        r = api.get(path, params={"run": RUN, name: value})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (value, r.text)
        assert r.json()["error"]["param"] == name, (value, r.text)
    assert api.get(path, params={"run": RUN, name: "1"}).status_code == 200


def test_unknown_rollout_endpoint_and_missing_ids_are_clear_errors(api: TestClient) -> None:
    assert "no rollout 'r-missing' in run" in error_of(
        api.get("/api/rollout", params={"run": RUN, "id": "r-missing"}), 404
    )
    assert "'id' parameter" in error_of(api.get("/api/tokens", params={"run": RUN}), 400)
    assert "no API endpoint /api/nothing" in error_of(api.get("/api/nothing"), 404)
    assert api.get("/api/rollouts", params={"run": RUN, "page": 99}).json()["rows"] == []


def test_runs_and_run_overview(api: TestClient, run_dir: tuple[Path, dict[str, str]]) -> None:
    # One run; its eval folders are its phases, not runs of their own.
    runs = {r["name"]: r for r in api.get("/api/runs").json()["runs"]}
    assert set(runs) == {RUN}
    phases = {p["phase"]: p for p in runs[RUN]["phases"]}
    assert set(phases) == {"eval-after-rl", "eval-after-sft", "eval-before-sft"}
    after_rl = phases["eval-after-rl"]
    assert after_rl["run"] == f"{RUN}/eval-after-rl"
    # No status.json: an eval folder that wrote its report finished.
    assert after_rl["status"] == {"state": "finished", "source": "report.json", "changed_at": None}
    assert after_rl["report"]["reward_mean"] == 0.7
    run = api.get("/api/run", params={"run": RUN}).json()
    assert run["steps"] == STEPS and run["last_metrics"]["reward_mean"] == 0.8
    assert "note" not in run["last_metrics"]
    assert run["totals"]["rollouts"] == 7 and run["totals"]["by_status"] == {
        "closed": 5,
        "failed": 1,
        "open": 1,
    }
    assert [e["name"] for e in run["evals"]] == ["before-sft", "after-sft", "after-rl"]
    assert run["config"]["algorithm"] == "grpo" and run["model"] == run["config"]["model_dir"]
    # No status.json: the store's open rollout says it runs (never a file's mtime).
    assert run["status"] == {"state": "running", "source": "store", "changed_at": None}


def test_metrics_are_read_incrementally(api: TestClient, run_dir: tuple[Path, dict[str, str]]) -> None:
    path = run_dir[0] / RUN / "metrics.jsonl"
    original = path.read_text()
    try:
        with path.open("a") as f:
            f.write('{"step": 13, "reward_mean": 0.9}\n{"step": 14, "reward_')  # the last line is unfinished
        rows = api.get("/api/metrics", params={"run": RUN, "after": 12}).json()["rows"]
        assert [r["step"] for r in rows] == [13]
        with path.open("a") as f:
            f.write('mean": 0.95}\n{"step": 13, "reward_mean": 0.91}\nnot json\n')
        rows = api.get("/api/metrics", params={"run": RUN, "after": 12}).json()["rows"]
        assert [(r["step"], r["reward_mean"]) for r in rows] == [
            (13, 0.91),
            (14, 0.95),
        ]  # a re-logged step: last wins
    finally:
        path.write_text(original)
    assert len(api.get("/api/metrics", params={"run": RUN}).json()["rows"]) == STEPS  # rewritten: read again


def test_rollouts_sort_filter_and_page(api: TestClient, run_dir: tuple[Path, dict[str, str]]) -> None:
    ids = run_dir[1]

    def get(**q: Any) -> Any:
        return api.get("/api/rollouts", params={"run": RUN, **q}).json()

    by_reward = get(sort="-reward")
    assert [r["reward"] for r in by_reward["rows"]][:3] == [1.0, 1.0, 0.75] and by_reward["total"] == 7
    assert by_reward["facets"]["dialect"] == ["anthropic", "openai"]
    branch = get(dialect="anthropic")["rows"]
    assert [r["id"] for r in branch] == [ids["branch"]]
    assert (
        branch[0]["failure"] == "timeout"
        and branch[0]["turns"] == 3
        and branch[0]["harness"] == "claude-code"
    )
    assert [r["id"] for r in get(sort="-turns", page_size=1)["rows"]] in ([ids["tools"]], [ids["branch"]])
    assert [r["task_id"] for r in get(task="arith", sort="task")["rows"]] == [f"arith-{i}" for i in range(4)]
    assert [r["reward"] for r in get(min_reward=0.3, max_reward=0.8, sort="reward")["rows"]] == [0.5, 0.75]
    page2 = get(sort="created", page=2, page_size=3)
    assert page2["total"] == 7 and len(page2["rows"]) == 3 and page2["rows"][0]["task_id"] == "arith-1"
    assert get(status="open")["rows"][0]["id"] == ids["open"]


def test_one_rollout_shows_turns_tools_verifier_and_branches(
    api: TestClient, run_dir: tuple[Path, dict[str, str]]
) -> None:
    ids = run_dir[1]
    tools = api.get("/api/rollout", params={"run": RUN, "id": ids["tools"]}).json()
    first, second, side = tools["calls"]
    assert [m["role"] for m in first["messages_delta"]] == ["system", "user"]
    assert first["response"]["tool_calls"][0]["function"]["name"] == "read_file"
    assert [m["role"] for m in second["messages_delta"]] == ["tool"] and second["reused_prompt_tokens"] > 0
    assert side["side_request"] and tools["samples"][1]["why"].startswith("side request")
    assert tools["runner"]["details"]["verifier"]["passed"] == ["mentions milk"]
    assert tools["rollout"]["details"]["checks"]["one line"] is True

    branch = api.get("/api/rollout", params={"run": RUN, "id": ids["branch"]}).json()
    assert {c["dialect"] for c in branch["calls"]} == {"anthropic"}
    tool_use = branch["calls"][0]["response"]["tool_calls"][0]
    assert tool_use["function"]["name"] == "Bash" and tool_use["function"]["arguments"] == {"command": "ls"}
    assert "history rewritten" in branch["calls"][2]["branch_reason"]
    assert [s["why"] for s in branch["samples"]][1].startswith("new branch: message 1 differs")
    assert branch["failure"] == "timeout" and branch["runner"] is None


def test_token_view_masks_logprobs_and_decoding(
    api: TestClient, run_dir: tuple[Path, dict[str, str]], tiny_model_dir: Path
) -> None:
    ids = run_dir[1]
    view = api.get("/api/tokens", params={"run": RUN, "id": ids["tools"]}).json()
    assert view["decoded"] and view["model"] == str(tiny_model_dir)
    main = view["samples"][0]
    assert set(main["loss_mask"]) == {0, 1} and len(main["call_ids"]) == 2
    text = "".join(
        view["pieces"][str(t)] for t, m in zip(main["input_ids"], main["loss_mask"], strict=True) if m
    )
    assert "buy milk and eggs" in text and "<|im_end|>" in text
    assert all(lp == -0.5 for lp, m in zip(main["logprobs"], main["loss_mask"], strict=True) if m)
    assert main["trainer_step"] == STEPS and main["importance_weights"][0] == 1.01
    # Without a tokenizer the ids alone are shown.
    bare = build_app(ViewerConfig(store=run_dir[0] / RUN / "gateway.db"))
    with TestClient(bare, base_url="http://127.0.0.1") as client:
        undecoded = client.get("/api/tokens", params={"run": RUN, "id": ids["tools"]}).json()
    assert not undecoded["decoded"] and undecoded["pieces"] == {}
    assert undecoded["samples"][0]["input_ids"] == main["input_ids"]


def test_the_viewer_cannot_write_the_store(run_dir: tuple[Path, dict[str, str]]) -> None:
    with contextlib.closing(StoreView(run_dir[0] / RUN / "gateway.db")) as view:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            view._db.execute("DELETE FROM rollouts")
        assert not view.missing_indexes  # the store's own schema carries the viewer's indexes


def test_a_store_alone_makes_one_run_per_run_id(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "gw.db")
    db.executescript(SCHEMA)
    db.executemany(
        "INSERT INTO rollouts (id, run_id, task_id, key_hash, reward, created_at) VALUES (?,?,?,?,?,?)",
        [("a", "", "t1", "k1", 1.0, 1.0), ("b", "exp-2", "t2", "k2", 0.0, 2.0)],
    )
    db.commit()
    db.close()
    with TestClient(build_app(ViewerConfig(store=tmp_path / "gw.db")), base_url="http://127.0.0.1") as client:
        runs = {r["name"]: r["totals"]["rollouts"] for r in client.get("/api/runs").json()["runs"]}
        assert runs == {"(no run id)": 1, "exp-2": 1}
        rows = client.get("/api/rollouts", params={"run": "(no run id)"}).json()["rows"]
        assert [(r["id"], r["turns"], r["dialect"], r["failure"]) for r in rows] == [("a", 0, "", "")]
        assert (
            client.get("/api/rollout", params={"run": "exp-2", "id": "a"}).status_code == 404
        )  # another run's


# -- the guard ----------------------------------------------------------------------------------
def test_a_token_is_required_when_set(run_dir: tuple[Path, dict[str, str]]) -> None:
    app = build_app(ViewerConfig(runs=run_dir[0], token="s3cret"))
    with TestClient(app, base_url="http://10.0.0.5") as client:
        assert "needs its token" in error_of(client.get("/api/runs"), 401)
        assert client.get("/", follow_redirects=False).status_code == 401
        assert client.get("/api/runs", headers={"authorization": "Bearer s3cret"}).status_code == 200
        swap = client.get("/?token=s3cret", follow_redirects=False)
        assert swap.status_code == 303 and swap.headers["location"] == "http://10.0.0.5/"
        assert client.get("/api/runs").status_code == 200  # the cookie it set
        client.cookies.clear()
        assert client.get("/api/runs?token=wrong").status_code == 401


def test_without_a_token_only_loopback_hosts_are_served(run_dir: tuple[Path, dict[str, str]]) -> None:
    with TestClient(build_app(ViewerConfig(runs=run_dir[0])), base_url="http://evil.example:8600") as client:
        assert "not loopback" in error_of(client.get("/api/runs"), 403)
    with TestClient(build_app(ViewerConfig(runs=run_dir[0])), base_url="http://[::1]:8600") as client:
        r = client.get("/")
        assert r.status_code == 200 and "default-src 'self'" in r.headers["content-security-policy"]


def test_cli_refuses_a_public_address_without_a_token(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["view", "--runs", str(tmp_path), "--host", "0.0.0.0"], env={"OPENFORGE_VIEW_TOKEN": ""}
    )
    assert result.exit_code == 2 and "not loopback: give --token" in result.output


def test_vendored_uplot_is_the_recorded_npm_file() -> None:
    vendor = Path(__file__).resolve().parents[2] / "src/openforgerl/ui/static/vendor"
    readme = (vendor / "README.md").read_text()
    for name in ("uplot/uPlot.esm.js", "uplot/uPlot.min.css"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in readme


# -- 100,000 rollouts ----------------------------------------------------------------------------
BIG = 100_000


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with 100,000 rollouts in two runs and 150,000 calls, written in bulk."""
    path = tmp_path_factory.mktemp("big") / "gateway.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA)
    for sql in VIEWER_INDEXES.values():
        db.execute(sql)
    rng = random.Random(0)
    outcomes = ['{"outcome": "ok"}', '{"outcome": "timeout"}', '{"outcome": "crash"}']
    db.executemany(
        "INSERT INTO rollouts (id, run_id, task_id, key_hash, status, reward, details, created_at, closed_at)"
        " VALUES (?,?,?,?,?,?,?,?,?)",
        (
            (
                f"r{i:06d}",
                "big" if i % 10 else "other",
                f"task-{i % 97:02d}",
                f"k{i}",
                "closed",
                rng.random() if i % 50 else None,
                outcomes[i % 3],
                1e9 + i,
                1e9 + i + rng.random() * 60,
            )
            for i in range(BIG)
        ),
    )
    prompt, completion = ids_to_blob(range(12)), ids_to_blob(range(5))
    db.executemany(
        "INSERT INTO calls (rollout_id, seq, branch_id, dialect, model, engine, status, prompt_delta,"
        " prompt_tokens, completion_ids, completion_logprobs, sampling_requested, sampling_used,"
        " messages_delta, response, created_at, latency_ms)"
        " VALUES (?,?,0,?,'m','e','ok',?,12,?,?,'{}','{}','[]','{}',0,1)",
        (
            (f"r{i % BIG:06d}", i // BIG, "openai" if i % 3 else "anthropic", prompt, completion, completion)
            for i in range(BIG * 3 // 2)
        ),
    )
    db.commit()
    db.close()
    return path


def test_every_page_query_walks_an_index_at_100k_rollouts(big_store: Path) -> None:
    with contextlib.closing(StoreView(big_store)) as view:
        assert view.missing_indexes == []
        for key in SORTS:
            for desc in (False, True):
                for filters in (
                    Filters(),
                    Filters(failure="timeout"),
                    Filters(dialect="openai"),
                    Filters(status="closed"),
                ):
                    ids_sql, _, params = page_query("big", key, desc, filters, 50, 40_000)
                    plan = " | ".join(view.explain(ids_sql, params))
                    assert "INDEX" in plan and "TEMP B-TREE" not in plan, (key, desc, filters, plan)
        total, rows = view.page("big", sort="reward", desc=True, filters=Filters(), page=1, page_size=50)
        assert total == BIG * 9 // 10 and len(rows) == 50
        rewards = [r["reward"] for r in rows]
        assert rewards == sorted(rewards, reverse=True)
        total, last = view.page("big", sort="turns", desc=False, filters=Filters(), page=900, page_size=100)
        assert len(last) == 100 and {r["turns"] for r in last} == {2}
        _, first = view.page("big", sort="turns", desc=False, filters=Filters(), page=1, page_size=5)
        assert {r["turns"] for r in first} == {1}


def test_the_api_pages_through_100k_rollouts(big_store: Path) -> None:
    with TestClient(build_app(ViewerConfig(store=big_store)), base_url="http://127.0.0.1") as client:
        runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
        assert runs["big"]["totals"]["rollouts"] == BIG * 9 // 10
        body = client.get(
            "/api/rollouts", params={"run": "big", "page": 1800, "page_size": 50, "sort": "-tokens"}
        ).json()
        assert body["total"] == BIG * 9 // 10 and len(body["rows"]) == 50
        body = client.get("/api/rollouts", params={"run": "big", "failure": "crash", "sort": "task"}).json()
        assert body["total"] == 30_000 and body["rows"][0]["failure"] == "crash"


# -- the browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def viewer_url(run_dir: tuple[Path, dict[str, str]]) -> Iterator[str]:
    with serve_viewer(ViewerConfig(runs=run_dir[0], poll_seconds=0.5)) as url:
        yield url


def _painted(page: Any, selector: str) -> int:
    """How many pixels of a chart's canvas are painted (0 for an empty canvas)."""
    return int(
        page.eval_on_selector(
            selector,
            """(el) => {
                const c = el.querySelector("canvas");
                const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
                let n = 0;
                for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
                return n;
            }""",
        )
    )


@pytest.mark.ui
def test_dashboard_curves_render_and_follow_a_live_run(
    browser: Any, viewer_url: str, run_dir: tuple[Path, dict[str, str]]
) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(viewer_url + "/")
    page.wait_for_selector(f"text={RUN}")
    shot(page, "01-runs")
    page.click(f"a:text-is('{RUN}')")
    reward = '.chart[data-chart="Reward and pass rate"]'
    page.wait_for_selector(f'{reward}[data-points="{STEPS}"]')
    assert _painted(page, reward) > 500
    assert (
        page.locator(".chart").count() >= 7
    )  # reward, throughput, time, loss, kl, clip, behaviour + rollouts/min
    acting = '.chart[data-chart="Behaviour: tool errors, recovery, give-ups"]'
    page.wait_for_selector(f'{acting}[data-points="{STEPS}"]')
    assert page.locator(".evals thead th").all_inner_texts()[1:] == ["before-sft", "after-sft", "after-rl"]
    shot(page, "02-run-dashboard", full_page=True)
    metrics = run_dir[0] / RUN / "metrics.jsonl"
    original = metrics.read_text()
    try:
        with metrics.open("a") as f:  # the trainer logs two more steps: the open page picks them up
            f.write('{"step": 13, "reward_mean": 0.86, "pass_rate": 0.8}\n')
            f.write('{"step": 14, "reward_mean": 0.9, "pass_rate": 0.85}\n')
        page.wait_for_selector(f'{reward}[data-points="{STEPS + 2}"]', timeout=15_000)
        assert "live" in page.inner_text("#live")
    finally:
        metrics.write_text(original)
    assert errors == []


@pytest.mark.ui
def test_a_newcomer_follows_one_rollout_from_task_to_tokens(
    browser: Any, viewer_url: str, run_dir: tuple[Path, dict[str, str]]
) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{viewer_url}/#/run/{RUN}/rollouts")
    page.wait_for_selector("table.rollouts tbody tr.link")
    page.click("th:has-text('Reward')")  # ascending, then descending
    page.wait_for_selector("th.sorted:has-text('▲')")
    page.click("th:has-text('Reward')")
    page.wait_for_selector("th.sorted:has-text('▼')")
    assert page.locator("table.rollouts tbody tr").count() == 7
    shot(page, "03-rollouts", full_page=True)
    page.click("a:text-is('notes-summary')")
    page.wait_for_selector(".call")
    assert page.locator(".call").count() == 3
    assert "calls tool read_file" in page.inner_text("#turns")
    assert "buy milk and eggs" in page.inner_text("#turns")
    assert "mentions milk" in page.inner_text("#verdict")
    acted = " ".join(page.inner_text("#verdict .behaviour").split())  # one read_file that answered
    assert "tool calls 1 tool errors 0 recovered after an error – gave up after an error –" in acted
    page.wait_for_selector(".seq .tok")
    masked, trained = page.locator(".seq .tok.m0").count(), page.locator(".seq .tok.m1").count()
    assert masked > 0 and trained > 0
    shot(page, "04-rollout", full_page=True)
    page.locator(".seq .tok.m1").nth(3).hover()
    page.wait_for_selector("#tip:not([hidden])")
    tip = page.inner_text("#tip")
    assert "behaviour logprob" in tip and "-0.5000" in tip and "importance weight" in tip
    page.locator("#tokens").scroll_into_view_if_needed()
    shot(page, "05-tokens")
    # The branched Anthropic rollout: same rendering, its new branch and the reason for it.
    page.goto(f"{viewer_url}/#/run/{RUN}/rollout/{run_dir[1]['branch']}")
    page.wait_for_selector(".call .branch")
    assert "history rewritten" in page.inner_text("#turns")
    assert page.locator("#samples tbody tr").count() == 2
    shot(page, "06-branched-rollout", full_page=True)
    assert errors == []
