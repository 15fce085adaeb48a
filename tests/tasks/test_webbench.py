"""WebVoyager and Online-Mind2Web task files as tasks, and the LLM judge that scores them.

The judge is asked through a REAL gateway of ours, in upstream mode; the upstream is a second
gateway of ours whose SCRIPTED engine plays the judge model: it answers SUCCESS or NOT SUCCESS
according to the final answer it is shown (and no verdict at all for an answer it does not know),
so the rewards below come from what reached the upstream, not from anything fixed in the test.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image as PILImage

from openforgerl.gateway.upstream import UpstreamSpec
from openforgerl.harnesses.launch import HarnessLaunch
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import (
    PythonVerifier,
    Task,
    TaskError,
    VerifierError,
    dump_tasks,
    load_tasks,
    verify_local,
)
from openforgerl.tasks.judge import judge, parse_verdict
from openforgerl.tasks.verify import GatewayAccess, VerifierUnavailable, run_python_verifier
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

FIXTURES = Path(__file__).parents[1] / "fixtures" / "webbench"
WEBVOYAGER = FIXTURES / "WebVoyager_data.jsonl"
MIND2WEB = FIXTURES / "Online_Mind2Web.json"
JUDGE = "openforgerl.tasks.judge:judge"
KEY_ENV = "TEST_JUDGE_KEY"
TASK = (
    "Provide a recipe for vegetarian lasagna with more than 100 reviews and a rating of at least 4.5 stars."
)
GOOD = "Vegetarian Four Cheese Lasagna: 4.6 stars from 181 reviews, serves 8."
BAD = "I could not find such a recipe."
UNSURE = "Maybe the second one."


REPLIES = {
    GOOD: "The answer names a recipe meeting the rating and review conditions.\n**Verdict:** SUCCESS",
    BAD: "The agent gave up without an answer.\nVerdict: NOT SUCCESS",
}


def judge_script(tokenizer: Any) -> Any:
    """The SCRIPTED judge model: its verdict follows the final answer in the request it receives."""

    def script(prompt: list[int]) -> str:
        text = tokenizer.decode(prompt)
        for answer, reply in REPLIES.items():
            if f"final answer: {answer}" in text:
                return reply
        return "I cannot tell what happened here."  # no verdict

    return script


# -- loaders ---------------------------------------------------------------------------------------


def records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    data: list[dict[str, Any]] = json.loads(path.read_text())
    return data


def test_webvoyager_records_become_gui_tasks_with_their_reference_answers(tmp_path: Path) -> None:
    tasks = load_tasks(f"webvoyager:{WEBVOYAGER}")
    raw = records(WEBVOYAGER)
    # Task ids are [A-Za-z0-9._-]: WebVoyager's spaces become '_'; the record keeps the original.
    assert [t.id for t in tasks] == [
        "Allrecipes--0",
        "Amazon--2",
        "Cambridge_Dictionary--1",
        "Google_Flights--3",
    ]
    for task, record in zip(tasks, raw, strict=True):
        assert task.instruction == record["ques"] and task.split == "test" and task.harness == "gui"
        assert task.harness_options == {"start_url": record["web"], "max_steps": 50}
        assert task.tags == ["webvoyager", f"site:{record['web_name']}"]
        assert task.metadata["record"] == record
        assert isinstance(task.verifier, PythonVerifier) and task.verifier.python == JUDGE
        assert task.verifier.kwargs["task"] == record["ques"]
    # reference_answer.json beside the file: by site and number, with its kind.
    by_id = {t.id: t.verifier.kwargs for t in tasks if isinstance(t.verifier, PythonVerifier)}
    assert by_id["Cambridge_Dictionary--1"]["reference_type"] == "golden"
    assert by_id["Cambridge_Dictionary--1"]["reference"].startswith("UK /səˌsteɪ.nəˈbɪl.ə.ti/")
    assert by_id["Allrecipes--0"]["reference_type"] == "possible"
    assert "reference" not in by_id["Google_Flights--3"]  # the time-sensitive task has none
    assert load_tasks(f"webvoyager:{WEBVOYAGER}", split="train") == []

    # What `openforge eval` may store and reload gives the same tasks; without the reference file
    # beside it, the judge gets no reference.
    dump_tasks(tasks, tmp_path / "dumped.jsonl")
    assert load_tasks(tmp_path / "dumped.jsonl") == tasks
    shutil.copy(WEBVOYAGER, tmp_path / "alone.jsonl")
    alone = load_tasks(f"webvoyager:{tmp_path / 'alone.jsonl'}")
    assert all("reference" not in t.verifier.kwargs for t in alone if isinstance(t.verifier, PythonVerifier))


def test_online_mind2web_levels_set_the_step_limits(tmp_path: Path) -> None:
    tasks = load_tasks(f"online-mind2web:{MIND2WEB}")
    raw = records(MIND2WEB)
    assert [t.id for t in tasks] == [r["task_id"] for r in raw]
    assert [r["level"] for r in raw] == ["easy", "medium", "hard", "easy"]
    assert [t.harness_options["max_steps"] for t in tasks] == [15, 50, 100, 15]
    easy, medium, hard, _ = tasks
    assert easy.timeout < medium.timeout < hard.timeout  # more steps, more time
    for task, record in zip(tasks, raw, strict=True):
        assert task.instruction == record["confirmed_task"] and task.split == "test" and task.harness == "gui"
        assert task.harness_options["start_url"] == record["website"]
        assert task.metadata == {"benchmark": "online-mind2web", "record": record}
        assert isinstance(task.verifier, PythonVerifier) and task.verifier.kwargs == {
            "task": record["confirmed_task"]
        }
    assert hard.tags == ["online-mind2web", "site:www.stubhub.com", "level:hard"]
    # The same records as JSON Lines load the same.
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(r) for r in raw) + "\n")
    assert load_tasks(f"online-mind2web:{tmp_path / 'tasks.jsonl'}") == tasks


VOYAGER_OK = {
    "web_name": "Amazon",
    "id": "Amazon--2",
    "ques": "Find a controller.",
    "web": "https://www.amazon.com/",
}
MIND2WEB_OK = {
    "task_id": "a1",
    "confirmed_task": "Do it.",
    "website": "https://example.com/",
    "level": "easy",
}


def jsonl(*rows: Any) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"


@pytest.mark.parametrize(
    ("fmt", "name", "content", "message"),
    [
        (
            "webvoyager",
            "wv.jsonl",
            jsonl(VOYAGER_OK, {k: v for k, v in VOYAGER_OK.items() if k != "ques"} | {"id": "Amazon--3"}),
            "line 2: missing field 'ques'",
        ),
        ("webvoyager", "wv.jsonl", jsonl(VOYAGER_OK, "", '{"web_name": "Amazon",'), "line 3: not valid JSON"),
        (
            "webvoyager",
            "wv.jsonl",
            jsonl(VOYAGER_OK | {"ques": " "}),
            "line 1: field 'ques' must be a non-empty",
        ),
        ("webvoyager", "wv.jsonl", jsonl(VOYAGER_OK | {"web": "www.amazon.com"}), "is not an http(s) URL"),
        ("webvoyager", "wv.jsonl", jsonl(VOYAGER_OK, VOYAGER_OK), "line 2: duplicate task id 'Amazon--2'"),
        ("webvoyager", "wv.jsonl", jsonl([VOYAGER_OK]), "line 1: expected a JSON object"),
        ("online-mind2web", "m.json", json.dumps(MIND2WEB_OK), "expected a JSON list of tasks"),
        (
            "online-mind2web",
            "m.json",
            json.dumps([MIND2WEB_OK, {"task_id": "b2", "website": "https://example.com/"}]),
            "entry 2 (task_id 'b2'): missing field 'confirmed_task'",
        ),
        (
            "online-mind2web",
            "m.json",
            json.dumps([MIND2WEB_OK | {"level": "expert"}]),
            "level 'expert' is not one of easy, medium, hard",
        ),
        ("online-mind2web", "m.json", "[{", "not valid JSON"),
    ],
    ids=[
        "wv-missing-field",
        "wv-bad-json",
        "wv-empty-field",
        "wv-not-a-url",
        "wv-duplicate-id",
        "wv-not-an-object",
        "m2w-not-a-list",
        "m2w-missing-field",
        "m2w-unknown-level",
        "m2w-bad-json",
    ],
)
def test_malformed_files_say_where_and_what(
    tmp_path: Path, fmt: str, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TaskError, match="^" + str(path).replace(".", r"\.")) as err:
        load_tasks(f"{fmt}:{path}")
    assert message in str(err.value)


def test_bad_reference_files_and_names(tmp_path: Path) -> None:
    shutil.copy(WEBVOYAGER, tmp_path / "WebVoyager_data.jsonl")
    (tmp_path / "reference_answer.json").write_text(
        json.dumps({"Amazon": {"answers": [{"id": "2", "ans": "x"}]}})
    )
    with pytest.raises(TaskError, match="site 'Amazon': an answer needs an integer 'id'"):
        load_tasks(f"webvoyager:{tmp_path / 'WebVoyager_data.jsonl'}")
    with pytest.raises(TaskError, match="no such file"):
        load_tasks(f"webvoyager:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(TaskError, match="webvoyager, online-mind2web"):
        load_tasks(f"webarena:{WEBVOYAGER}")  # not a format: then neither a file nor a suite


def test_parse_verdict_reads_the_verdict_not_the_reasoning() -> None:
    assert parse_verdict("Looks right.\n**Verdict:** SUCCESS") == "SUCCESS"
    assert (
        parse_verdict("The search was successful but the date is wrong.\nVerdict: NOT SUCCESS")
        == "NOT SUCCESS"
    )
    assert parse_verdict("verdict - not successful") == "NOT SUCCESS"
    assert parse_verdict('Thoughts...\nStatus: "failure"') == "NOT SUCCESS"
    assert parse_verdict("Status: success") == "SUCCESS"
    assert parse_verdict("The agent did not succeed in finding it.\n\nNOT_SUCCESS") == "NOT SUCCESS"
    assert parse_verdict("Everything checks out.\n`SUCCESS`") == "SUCCESS"
    # Lower-case words in the reasoning are no verdict.
    assert parse_verdict("The agent was not successful at first, then succeeded.") is None
    assert parse_verdict("") is None


# -- the judge, through real gateways --------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    engine.script = judge_script(engine.tokenizer)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("judge-upstream"), engine) as gw:
        yield gw


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, upstream: Any) -> Iterator[Any]:
    """The gateway the judge goes through: its policy is never asked, the upstream answers."""
    policy = ScriptEngine(tiny_model_dir, lambda prompt: "the POLICY answered")
    spec = UpstreamSpec("judge", "openai", "judge-model", upstream.url + "/v1", KEY_ENV)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("gw"), policy, upstreams=[spec]) as g:
        yield g
    assert policy.prompts == []


@pytest.fixture()
def teacher(upstream: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A rollout on the upstream; the gateway under test reads its key from the environment."""
    rollout = new_rollout(upstream, run_id="judge-model")
    monkeypatch.setenv(KEY_ENV, rollout["api_key"])
    return rollout


def access(gw: Any, **kw: Any) -> GatewayAccess:
    fields = {"run_id": "eval", "rollout_id": "ro_policy", "task_id": "Allrecipes--0"} | kw
    return GatewayAccess(gw.url, gw.gateway.admin_token, **fields)


COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]


def gui_workdir(root: Path, answer: str | None, shots: int = 3) -> Path:
    """A work dir as the GUI harness leaves it: result.json and one distinct screenshot per step."""
    gui = root / ".openforge" / "gui"
    gui.mkdir(parents=True)
    result = {
        "answer": answer,
        "steps": shots,
        "stopped": "answer",
        "url": "https://www.allrecipes.com/recipe/1",
    }
    (gui / "result.json").write_text(json.dumps(result))
    for i in range(shots):
        PILImage.new("RGB", (64, 48), COLORS[i % len(COLORS)]).save(gui / f"step-{i + 1:03d}.png")
    return root


def rollout_row(gw: Any, rollout_id: str) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/admin/rollouts/{rollout_id}", headers=gw.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def test_the_judge_scores_through_the_gateways_upstream(
    gw: Any, upstream: Any, teacher: dict[str, Any], tmp_path: Path
) -> None:
    cases = [(GOOD, 1.0, "SUCCESS"), (BAD, 0.0, "NOT SUCCESS")]
    for n, (answer, reward, verdict) in enumerate(cases):
        workdir = gui_workdir(tmp_path / str(n), answer)
        out = judge(workdir, task=TASK, screenshots=0, gateway=access(gw))
        assert (out["reward"], out["verdict"]) == (reward, verdict)
        assert out["reason"] == REPLIES[answer].splitlines()[0]
        assert out["answer"] == answer and out["screenshots"] == 0

        # The judge rollout: in the run's judge run, naming the rollout it scored, closed with the reward.
        row = rollout_row(gw, out["judge_rollout"])
        assert (row["run_id"], row["task_id"], row["status"], row["reward"]) == (
            "eval-judge",
            "Allrecipes--0",
            "closed",
            reward,
        )
        assert row["metadata"] == {"judges": "ro_policy", "upstream": "judge"}
        assert row["details"] == {"verdict": verdict}
        # Its one call was answered by the upstream, recorded as text.
        [call] = calls_of(gw, out["judge_rollout"])
        assert (call["status"], call["engine"], call["model"]) == ("ok", "upstream:openai", "judge-model")
        assert call["sampling_used"]["upstream"] == "judge" and call["sampling_used"]["temperature"] == 0.0
        assert call["response"]["content"] == REPLIES[answer]

    # The upstream got both judging requests: the judge's instructions, the task and the answer.
    seen = calls_of(upstream, teacher["rollout_id"])
    assert len(seen) == 2
    for call, (answer, _, _) in zip(seen, cases, strict=True):
        texts = [m["content"] for m in call["messages_delta"]]
        assert texts[0].startswith("You evaluate web-browsing agents.")
        assert f"Task: {TASK}" in texts[-1] and f"The agent's final answer: {answer}" in texts[-1]
        assert "on https://www.allrecipes.com/recipe/1" in texts[-1]


def test_judge_failures_are_verifier_errors_and_a_judge_it_cannot_ask_is_infrastructure(
    gw: Any, teacher: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the agent left that cannot be judged is a verifier error (the runner scores it 0); a
    judge that cannot be asked is VerifierUnavailable (the runner retries it, never scores it)."""
    verifier = PythonVerifier(python=JUDGE, kwargs={"task": TASK, "screenshots": 0})
    good = gui_workdir(tmp_path / "good", GOOD)

    def fails(
        workdir: Path, gateway: GatewayAccess | None, message: str, *, unavailable: bool, **kwargs: Any
    ) -> None:
        v = verifier.model_copy(update={"kwargs": verifier.kwargs | kwargs})
        with pytest.raises(VerifierError, match=message) as raised:
            run_python_verifier(v, workdir, gateway)
        assert isinstance(raised.value, VerifierUnavailable) == unavailable, raised.value

    empty = tmp_path / "empty"
    empty.mkdir()
    fails(empty, access(gw), r"no \.openforge/gui/result\.json in the work directory", unavailable=False)
    monkeypatch.delenv("OPENFORGE_GATEWAY_URL", raising=False)
    fails(good, None, "the judge needs the gateway", unavailable=True)
    fails(good, access(gw), "Unknown upstream 'nope'", unavailable=True, upstream="nope")
    fails(
        good,
        GatewayAccess("http://127.0.0.1:9", "x"),
        "cannot reach the gateway's admin API",
        unavailable=True,
    )
    fails(good, GatewayAccess(gw.url, "wrong"), r"refused POST /admin/rollouts \(401\)", unavailable=True)
    monkeypatch.delenv(KEY_ENV)  # the judge gateway's own key trouble: the call fails, said so
    fails(good, access(gw, run_id="nokey"), f"failed with 500: .*\\${KEY_ENV} is not set", unavailable=True)
    monkeypatch.setenv(KEY_ENV, teacher["api_key"])
    # An answer without a verdict: an error, and the judge rollout is closed as failed.
    unsure = gui_workdir(tmp_path / "unsure", UNSURE)
    fails(unsure, access(gw, run_id="unsure"), "holds no verdict", unavailable=False)
    r = httpx.get(f"{gw.url}/admin/rollouts", params={"run_id": "unsure-judge"}, headers=gw.admin_headers)
    [row] = r.json()["rollouts"]
    assert row["status"] == "failed" and row["reward"] is None and "no verdict" in row["details"]["error"]

    # Outside a runner the environment names the gateway (here through verify_local).
    monkeypatch.setenv("OPENFORGE_GATEWAY_URL", gw.url)
    monkeypatch.setenv("OPENFORGE_ADMIN_TOKEN", gw.gateway.admin_token)
    task = Task(id="t", instruction=TASK, split="test", verifier=verifier)
    result = verify_local(task, good)
    assert result.reward == 1.0 and result.details["verdict"] == "SUCCESS"


def asks_for_the_gateway(workdir: Path, gateway: GatewayAccess | None = None) -> dict[str, Any]:
    return {"reward": 1.0, "gateway": gateway}


def takes_any_kwargs(workdir: Path, **kwargs: Any) -> dict[str, Any]:
    return {"reward": 1.0, "kwargs": sorted(kwargs)}


def test_only_verifiers_that_declare_it_get_the_gateway(tmp_path: Path) -> None:
    access = GatewayAccess("http://gw", "secret", "run", "ro_1", "t")
    asks = PythonVerifier(python="tests.tasks.test_webbench:asks_for_the_gateway")
    assert run_python_verifier(asks, tmp_path, access).details == {"gateway": access}
    assert run_python_verifier(asks, tmp_path).details == {"gateway": None}
    plain = PythonVerifier(python="tests.tasks.test_webbench:takes_any_kwargs", kwargs={"x": 1})
    assert run_python_verifier(plain, tmp_path, access).details == {"kwargs": ["x"]}  # no admin token


def test_the_runner_gives_the_judge_the_gateway_and_the_rollout_it_scores(
    gw: Any, teacher: dict[str, Any], tmp_path: Path
) -> None:
    """A GUI-like harness leaves result.json (its answer depends on the task); the runner's judge
    scores each rollout through the gateway and the judge rollouts name the rollouts they scored."""
    answers = {"Allrecipes--0": GOOD, "Amazon--2": BAD}
    tasks = []
    for task in load_tasks(f"webvoyager:{WEBVOYAGER}")[:2]:
        assert isinstance(task.verifier, PythonVerifier)
        verifier = task.verifier.model_copy(update={"kwargs": task.verifier.kwargs | {"screenshots": 0}})
        tasks.append(task.model_copy(update={"verifier": verifier}))

    async def gui_like(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        result = {
            "answer": answers[task.id],
            "steps": 1,
            "stopped": "answer",
            "url": task.harness_options["start_url"],
        }
        out = ".openforge/gui/result.json"
        write = f"mkdir -p .openforge/gui && printf %s {shlex.quote(json.dumps(result))} > {out}"
        return HarnessLaunch(["sh", "-c", write], {})

    cfg = RunnerConfig(
        gateway_url=gw.url,
        admin_token=gw.gateway.admin_token,
        run_id="bench",
        state_path=tmp_path / "runner.db",
        network="host",  # the tasks are on live sites (the harness here never goes there)
    )

    async def go() -> list[Any]:
        runner = Runner(cfg, LocalBackend(), gui_like)
        try:
            return await runner.run(tasks)
        finally:
            await runner.close()

    results = asyncio.run(go())
    assert [(r.task_id, r.status, r.reward) for r in results] == [
        ("Allrecipes--0", Status.DONE, 1.0),
        ("Amazon--2", Status.DONE, 0.0),
    ]
    for r in results:
        details = r.details["verifier"]
        assert details["verdict"] == ("SUCCESS" if r.reward else "NOT SUCCESS")
        row = rollout_row(gw, details["judge_rollout"])
        assert row["run_id"] == "bench-judge" and row["task_id"] == r.task_id
        assert row["metadata"]["judges"] == r.gateway_rollout_id and row["reward"] == r.reward
        # The policy's own rollout is a different one, closed with the same reward by the runner.
        assert rollout_row(gw, r.gateway_rollout_id)["reward"] == r.reward


class ImageRecordingEngine(ScriptEngine):
    """The SCRIPTED judge model behind a vision upstream: it also keeps the images of each request."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.script = judge_script(self.tokenizer)
        self.images: list[list[str]] = []

    async def generate(self, prompt_ids: list[int], sampling: Any, images: Any = ()) -> Any:
        self.images.append([im.digest for im in images])
        return await super().generate(prompt_ids, sampling, images)


def test_the_judge_sends_the_last_screenshots_to_the_upstream(
    tiny_vlm_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = ImageRecordingEngine(tiny_vlm_dir)
    with running_gateway(tiny_vlm_dir, tmp_path / "vision-upstream", engine) as vision:
        teacher = new_rollout(vision, run_id="judge-model")
        monkeypatch.setenv(KEY_ENV, teacher["api_key"])
        spec = UpstreamSpec("judge", "openai", "judge-model", vision.url + "/v1", KEY_ENV)
        # The judge's gateway serves a text-only policy: images of an upstream's rollout are no issue.
        policy = ScriptEngine(tiny_model_dir)
        with running_gateway(tiny_model_dir, tmp_path / "gw", policy, upstreams=[spec]) as gw:
            workdir = gui_workdir(tmp_path / "run", GOOD, shots=4)
            out = judge(workdir, task=TASK, screenshots=2, gateway=access(gw))
            assert (out["reward"], out["screenshots"]) == (1.0, 2)
            [call] = calls_of(gw, out["judge_rollout"])
        seen = calls_of(vision, teacher["rollout_id"])
    shots = sorted((workdir / ".openforge" / "gui").glob("step-*.png"))
    last_two = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shots[-2:]]
    # The last two of the four screenshots, oldest first, reached the judge model and both records.
    assert engine.images == [last_two]
    assert call["image_digests"] == last_two
    assert [c["image_digests"] for c in seen] == [last_two]
