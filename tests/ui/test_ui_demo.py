"""The viewer tells a demo run's story (issue #27), on a real `make demo-quick` run folder made once
for the module: one run with its phases and their states (from the run's own status.json), each
evaluation in full, the before/after comparison with paired intervals that are report.json's, and
from each task its rollouts under both models. In Debian's Chromium (marker `ui`), screenshots in
test-artifacts/ui/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from openforgerl import demo
from openforgerl.eval_stats import paired_difference
from openforgerl.ui import ViewerConfig, build_app
from tests.ui_helpers import serve_viewer, shot

pytestmark = [pytest.mark.ui, pytest.mark.timeout(900)]

PHASES = [
    "model",
    "teacher",
    "eval-before",
    "sft",
    "eval-sft",
    "eval-sft-greedy",
    "eval-sft-reworded",
    "rl",
    "eval-rl",
    "eval-rl-greedy",
    "eval-rl-reworded",
    "report",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make demo-quick`'s command into a fresh folder (its own process: the browser's Playwright
    runs an event loop in this one)."""
    out = tmp_path_factory.mktemp("runs") / "demo-quick"
    argv = [sys.executable, "-m", "openforgerl.demo", "--quick", "--no-progress", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # It ends with the command that opens this story in the viewer.
    assert done.stdout.rstrip().splitlines()[-1] == demo.viewer_line(out)
    return out


@pytest.fixture(scope="module")
def api(demo_dir: Path) -> Iterator[TestClient]:
    config = ViewerConfig(runs=demo_dir, model=demo_dir / "model")
    with TestClient(build_app(config), base_url="http://127.0.0.1") as client:
        yield client


@pytest.fixture(scope="module")
def url(demo_dir: Path) -> Iterator[str]:
    with serve_viewer(ViewerConfig(runs=demo_dir, model=demo_dir / "model", poll_seconds=0.5)) as found:
        yield found


def report_of(demo_dir: Path) -> Any:
    return json.loads((demo_dir / "report.json").read_text())


def test_the_demo_is_one_run_with_its_phases_and_their_states(api: TestClient, demo_dir: Path) -> None:
    runs = api.get("/api/runs").json()["runs"]
    assert [r["name"] for r in runs] == ["demo-quick"]  # not model, rl, rl#rl-step1, ... sft, teacher
    run = runs[0]
    assert run["status"]["state"] == "finished" and run["status"]["source"] == "status.json"
    phases = run["phases"]
    # Every phase in the order the demo ran it, then the folders below the run it did not name.
    assert [p["phase"] for p in phases] == [*PHASES, "teacher/heldout"]
    assert {p["status"]["state"] for p in phases} == {"finished"}
    by = {p["phase"]: p for p in phases}
    assert by["model"]["run"] is None and by["report"]["run"] is None  # a model folder is not a run
    assert by["eval-rl-reworded"]["run"] == "demo-quick/eval/rl-reworded"  # nested eval/ folders found
    assert by["eval-rl-reworded"]["status"]["source"] == "status.json"  # written by run_eval itself
    assert by["sft"]["status"]["source"] == "the run's status.json"  # the demo's record of it
    assert by["rl"]["steps"] == 2  # training steps: the starting policy's measurements (step 0) are not one
    # The RL steps are steps of the rl run, each with its rollouts.
    rl = api.get("/api/run", params={"run": "demo-quick/rl"}).json()
    assert rl["status"]["state"] == "finished"
    # The SFT policy's headroom (2 tasks x k=2, before step 1), then the steps (2 tasks x G=2 each).
    assert [s["run_id"] for s in rl["step_runs"]] == ["rl-headroom", "rl-step1", "rl-step2"]
    assert [s["totals"]["rollouts"] for s in rl["step_runs"]] == [4, 4, 4]


def test_comparison_api_is_report_json(api: TestClient, demo_dir: Path) -> None:
    report = report_of(demo_dir)
    groups = api.get("/api/run", params={"run": "demo-quick"}).json()["comparisons"]
    assert [[name.rsplit("/", 1)[1] for name in g["runs"]] for g in groups] == [
        ["before", "sft", "rl"],
        ["sft-greedy", "rl-greedy"],
        ["sft-reworded", "rl-reworded"],
    ]
    for key, metric, stage in (
        ("rl_minus_sft", "pass@1", ""),
        ("rl_minus_sft", "greedy pass@1", "-greedy"),
        ("rl_minus_sft_reworded", "pass@1", "-reworded"),
    ):
        runs = [f"demo-quick/eval/sft{stage}", f"demo-quick/eval/rl{stage}"]
        got = api.get("/api/compare", params=[("runs", r) for r in runs]).json()
        row = next(m for m in got["overall"] if m["metric"] == "pass@1")
        assert row["differences"] == [report[key][metric]]
    # Three evaluations: before -> SFT, SFT -> RL, before -> RL, each paired over the same tasks.
    names = [f"demo-quick/eval/{s}" for s in ("before", "sft", "rl")]
    got = api.get("/api/compare", params=[("runs", r) for r in names]).json()
    assert [(p["from"], p["to"]) for p in got["pairs"]] == [
        (names[0], names[1]),
        (names[1], names[2]),
        (names[0], names[2]),
    ]
    tasks = [t["task_id"] for t in got["by_task"]]
    assert len(tasks) == 4 and {t["tasks"] for t in got["by_tag"]} == {1}  # 4 families, one task each
    per = [
        {
            t["task_id"]: t["pass@k"]["1"]
            for t in json.loads((demo_dir / f"eval/{s}/report.json").read_text())["summary"]["per_task"]
        }
        for s in ("before", "sft", "rl")
    ]
    assert got["overall"][0]["differences"][2] == paired_difference(per[0], per[2]).as_dict()
    assert got["overall"][0]["differences"][0] == report["sft_minus_before"]["pass@1"]
    # The reworded tasks are other tasks: no paired comparison with the held-out ones, said plainly.
    mixed = api.get("/api/compare", params=[("runs", names[2]), ("runs", "demo-quick/eval/rl-reworded")])
    assert mixed.status_code == 400 and "did not evaluate the same tasks" in mixed.text


def _badges(page: Any) -> dict[str, str]:
    rows = page.locator("table.runs tr.phase-row")
    return {
        rows.nth(i).locator("td").nth(0).inner_text().removeprefix("↳ ").strip(): rows.nth(i)
        .locator(".badge")
        .inner_text()
        for i in range(rows.count())
    }


def test_runs_list_shows_one_demo_run_with_its_phases(browser: Any, url: str) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_selector("table.runs tr.run-row")
    assert page.locator("table.runs tr.run-row").count() == 1
    top = page.locator("table.runs tr.run-row")
    assert top.locator("td").nth(0).inner_text() == "demo-quick"
    assert top.locator(".badge").inner_text() == "finished"
    badges = _badges(page)
    assert list(badges) == [*PHASES, "teacher/heldout"]
    assert set(badges.values()) == {"finished"}
    assert "#" not in page.inner_text("table.runs")  # no rl#rl-stepN rows
    shot(page, "10-demo-runs", full_page=True)
    page.click("table.runs tr.run-row a")
    page.wait_for_selector("table.phases")
    assert page.locator("table.phases tbody tr").count() == len(PHASES) + 1
    assert page.locator("ul.comparisons li").count() == 3
    shot(page, "11-demo-run", full_page=True)
    # RL: one run, finished, its GRPO steps a table of their own (not rows of the runs list).
    page.click("table.phases a:text-is('rl')")
    page.wait_for_selector("table.steps")
    assert page.locator("#run-state .badge").inner_text() == "finished"
    steps = page.locator("table.steps tbody tr td:first-child").all_inner_texts()
    assert steps == ["rl-headroom", "rl-step1", "rl-step2"]
    # Step 0 (the SFT policy's headroom, measured before the first update) and the two GRPO steps.
    assert page.locator('.chart[data-chart="Reward and pass rate"][data-points="3"]').count() == 1
    shot(page, "15-rl-steps", full_page=True)
    page.click("table.steps a:text-is('rl-step2')")
    page.wait_for_selector("table.rollouts tbody tr.link")
    assert page.locator("table.rollouts tbody tr").count() == 4  # 2 tasks x G=2
    assert page.locator("#crumbs").inner_text().split() == [
        "Runs",
        "›",
        "demo-quick/rl",
        "›",
        "rl-step2",
        "›",
        "Rollouts",
    ]
    assert errors == []


def test_comparison_view_before_after_matches_report_json(browser: Any, url: str, demo_dir: Path) -> None:
    report = report_of(demo_dir)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#/run/demo-quick")
    page.click("ul.comparisons a:text-is('before → sft → rl')")
    page.wait_for_selector("table.compare-overall")
    heads = page.locator("table.compare-overall thead th").all_inner_texts()
    assert heads == ["metric", "before", "sft", "rl", "sft − before", "rl − sft", "rl − before"]
    row = page.locator('table.compare-overall tr[data-metric="pass@1"] td')
    gain = report["rl_minus_sft"]["pass@1"]  # the demo's own paired RL - SFT
    rl_minus_sft = row.nth(4)
    assert {k: float(rl_minus_sft.get_attribute(f"data-{k}")) for k in ("estimate", "low", "high")} == gain

    def signed(v: float) -> str:
        return f"{'+' if v >= 0 else '−'}{abs(v):.3f}"

    assert (
        rl_minus_sft.inner_text()
        == f"{signed(gain['estimate'])} [{signed(gain['low'])}, {signed(gain['high'])}]"
    )
    sft = report["evaluations"]["sft"]["pass@1"]  # each model's own interval, as reported
    assert row.nth(1).inner_text() == f"{sft['estimate']:.3f} [{sft['low']:.3f}, {sft['high']:.3f}]"
    # Per task family: each of the report's families, with its paired difference.
    tags = page.locator("table.compare-tags tbody tr").evaluate_all("rows => rows.map(r => r.dataset.tag)")
    assert tags == sorted(report["evaluations"]["sft"]["by_family"])
    assert page.locator("table.compare-behaviour").inner_text().count("recovered after an error") == 1
    shot(page, "12-compare-before-after", full_page=True)

    # A task's rollouts under the model before training and after it.
    task = page.locator("table.compare-tasks tbody tr").first.get_attribute("data-task")
    links = page.locator("table.compare-tasks tbody tr").first.locator("a.task-rollouts")
    assert links.count() == 3
    hrefs = [links.nth(i).get_attribute("href") for i in range(3)]
    for i, stage in ((0, "before"), (2, "rl")):
        page.goto(url + "/" + hrefs[i])
        page.wait_for_selector("table.rollouts tbody tr.link")
        assert page.locator("h1").inner_text() == f"demo-quick/eval/{stage}"
        tasks = page.locator("table.rollouts tbody tr td:first-child").all_inner_texts()
        assert tasks == [task, task]  # n = 2 runs of this task under this model
        if stage == "rl":
            shot(page, "13-task-rollouts-after-rl", full_page=True)
            page.click("table.rollouts tbody tr.link a")
            page.wait_for_selector("#verdict .behaviour")  # the rollout's tool errors, recovery, ...
            assert "tool errors" in page.inner_text("#verdict .behaviour")
    assert errors == []


def test_an_evaluation_page_has_intervals_tags_tasks_failures_behaviour(
    browser: Any, url: str, demo_dir: Path
) -> None:
    own = json.loads((demo_dir / "eval" / "rl" / "report.json").read_text())
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#/run/demo-quick")
    page.click("table.phases a:text-is('eval-rl')")
    page.wait_for_selector("table.eval-summary")
    p1 = own["summary"]["pass@k"]["1"]
    assert page.inner_text('table.eval-summary tr[data-metric="pass@1"] td') == (
        f"{p1['estimate']:.3f} [{p1['low']:.3f}, {p1['high']:.3f}]"
    )
    assert page.locator('table.eval-summary tr[data-metric="pass^2"]').count() == 1
    assert page.locator("table.by-tag tbody tr").count() == len(own["by_tag"])
    assert page.locator("table.per-task tbody tr").count() == own["summary"]["tasks"]
    acted = page.inner_text("table.behaviour-table")
    assert "recovered after an error" in acted and "read back its own write" in acted
    page.wait_for_selector("text=Failures")
    shot(page, "14-evaluation", full_page=True)
    assert errors == []
