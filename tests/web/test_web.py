"""The web-basic sites, verifiers and suite (plain tests), and the GUI harness in a real sandbox
driving Debian's Chromium (marker `ui`, run by `make test-ui`).

The plain tests solve every task of the suite over HTTP, through the sites' own forms (an oracle
reading the pages as a browser would submit them), and check each verifier says 1 after and 0
before. The browser tests run `openforgerl.harnesses.gui` inside local sandboxes through the runner,
against a test-local OpenAI-compatible server whose policy is SCRIPTED: it reads the control
positions that `--a11y` adds to each observation and clicks there. It is a test device, not a
model: it shows that the harness, the browser, the sites and the verifiers work together, that
solved tasks score 1, and that tasks done wrong on purpose score 0.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import io
import itertools
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from openforgerl.evaluate import EvalOptions, harness_choice
from openforgerl.harnesses.gui import History
from openforgerl.harnesses.launch import gui_harness, python_binds
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import Limits, SandboxSpec
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Task, load_tasks
from openforgerl.tasks.verify import run_python_verifier, write_files
from openforgerl.web import SEED_FILE, STATE_FILE, booking, settings, shop, wiki
from openforgerl.web.serve import build_app
from openforgerl.web.verify import RESULT_FILE, check, matches

TASKS = load_tasks("web-basic")
BY_ID = {t.id: t for t in TASKS}


# -- reading pages as a browser submits them --------------------------------------------------------
class Page(HTMLParser):
    """Form fields (what a browser would submit), table rows, links and text of one HTML page."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.fields: dict[str, str] = {}
        self.rows: list[list[str]] = []
        self.links: list[tuple[str, str]] = []
        self.buttons: list[dict[str, str]] = []  # attributes of every <button>, with its form's hidden fields
        self._hidden: dict[str, str] = {}
        self._select: str | None = None
        self._option: dict[str, str] | None = None
        self._textarea: str | None = None
        self._cell: list[str] | None = None
        self._link: str | None = None
        self._text: list[str] = []
        self.feed(text)
        self.text = " ".join("".join(self._text).split())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self._hidden = {}
        elif tag == "input":
            kind, name = a.get("type", "text"), a.get("name", "")
            if kind == "hidden":
                self._hidden[name] = a.get("value", "")
            elif kind in ("checkbox", "radio"):
                if "checked" in a:
                    self.fields[name] = a.get("value", "on")
            elif name:
                self.fields[name] = a.get("value", "")
        elif tag == "select":
            self._select = a.get("name")
        elif tag == "option":
            self._option = a
            self._option["_text"] = ""
        elif tag == "textarea":
            self._textarea = a.get("name", "")
            self.fields[self._textarea] = ""
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "a":
            self._link, self._link_text = a.get("href", ""), []
        elif tag == "button":
            self.buttons.append({**self._hidden, **a})

    def handle_endtag(self, tag: str) -> None:
        if tag == "option" and self._option is not None and self._select:
            if "selected" in self._option:
                self.fields[self._select] = self._option["_text"].strip()
            self._option = None
        elif tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None
        elif tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "a" and self._link is not None:
            self.links.append((self._link, " ".join("".join(self._link_text).split())))
            self._link = None

    def handle_data(self, data: str) -> None:
        self._text.append(data)
        if self._option is not None:
            self._option["_text"] += data
        if self._textarea is not None:
            self.fields[self._textarea] += data
        if self._cell is not None:
            self._cell.append(data)
        if self._link is not None:
            self._link_text.append(data)


def _ok(response: Any) -> Page:
    assert response.status_code == 200, response.text[-500:]
    return Page(response.text)


def _answer(workdir: Path, text: str, stopped: str = "answered") -> None:
    path = workdir / RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"answer": text, "stopped": stopped, "steps": 3, "url": "/"}))


def solve_over_http(task: Task, client: TestClient, workdir: Path) -> None:
    """The oracle: does the task through the site's pages and forms (never its database)."""
    kw = dict(task.verifier.kwargs)  # type: ignore[union-attr]
    family = task.metadata["family"]
    if kw["kind"] == "order":
        home = _ok(client.get("/"))
        ids = {
            b["aria-label"].removeprefix("Add ").removesuffix(" to cart"): b["product_id"]
            for b in home.buttons
        }
        for name, qty in kw["items"].items():
            for _ in range(qty):
                _ok(client.post("/cart/add", data={"product_id": ids[name]}))
        _ok(client.post("/checkout", data={"name": kw["name"], "shipping": kw["shipping"]}))
    elif kw["kind"] == "booking":
        form = {"name": kw["name"], "date": kw["date"], "party": str(kw["party"])}
        time_ = task.metadata.get("asked_time", kw["time"])
        # As the instruction says: the asked time, else the next later ones in order.
        for slot in booking.SLOTS[booking.SLOTS.index(time_) :]:
            r = client.post("/book", data={**form, "time": slot})
            if r.status_code == 200:
                break
            assert "fully booked" in r.text
    elif kw["kind"] == "settings":
        values = _ok(client.get("/")).fields
        for key, value in kw["values"].items():
            if key in settings.TOGGLES and value == "off":
                values.pop(key, None)  # an unchecked box is not sent
            else:
                values[key] = value
        _ok(client.post("/", data=values))
    elif kw["kind"] == "wiki_edit":
        edit = _ok(client.get(f"/wiki/{kw['slug']}/edit"))
        body = edit.fields["body"]
        if "append" in kw:
            body = body.rstrip() + "\n" + kw["append"] + "\n"
        for key, value in kw.get("facts", {}).items():
            body = re.sub(rf"^{key}: .*$", f"{key}: {value}", body, count=1, flags=re.M)
        _ok(client.post(f"/wiki/{kw['slug']}/edit", data={"body": body, "summary": "fix"}))
    elif family == "price":
        product = re.search(r"the (.+?) cost", task.instruction).group(1)  # type: ignore[union-attr]
        row = next(r for r in _ok(client.get("/")).rows if r[0] == product)
        _answer(workdir, row[1])
    elif family == "lookup":
        name = re.search(r"name (.+?)\. At", task.instruction).group(1)  # type: ignore[union-attr]
        row = next(r for r in _ok(client.get("/bookings")).rows if r[2] == name)
        _answer(workdir, row[1])
    elif family in ("year", "measure"):
        title = re.search(r"was (.+?) (founded|born)|is (.+?),", task.instruction)
        assert title is not None
        name = title.group(1) or title.group(3)
        hits = _ok(client.get("/search", params={"q": name})).links
        href = next(h for h, text in hits if text == name)
        facts = {r[0]: r[1] for r in _ok(client.get(href)).rows if len(r) == 2}
        fact = {"founded": "Founded", "born": "Born"}.get(title.group(2) or "", "")
        if not fact:
            fact = "Height" if "high" in task.instruction else "Depth"
        _answer(workdir, facts[fact].removesuffix(" m"))
    elif family == "email":
        _answer(workdir, _ok(client.get("/")).fields["email"])
    else:
        raise AssertionError(f"no oracle for {task.id}")


def _site(task: Task, workdir: Path) -> TestClient:
    write_files(task.files, workdir)
    return TestClient(build_app(task.harness_options["site"], workdir / STATE_FILE))


def _score(task: Task, workdir: Path) -> float:
    return run_python_verifier(task.verifier, workdir).reward  # type: ignore[arg-type]


# -- the suite ---------------------------------------------------------------------------------------
def test_the_suite_has_every_family_in_both_splits() -> None:
    assert len(TASKS) >= 32 and len(BY_ID) == len(TASKS)
    splits = collections.Counter(t.split for t in TASKS)
    assert splits["train"] == 3 * splits["heldout"]
    families = collections.defaultdict(set)
    for t in TASKS:
        families[(t.metadata["site"], t.metadata["family"])].add(t.split)
        assert t.harness == "gui" and t.harness_options["max_steps"] == 15
        assert t.harness_options["site"] in ("shop", "booking", "wiki", "settings")
        assert t.verifier.python == "openforgerl.web.verify:check"  # type: ignore[union-attr]
        assert json.loads(t.files[SEED_FILE])["site"] == t.harness_options["site"]  # type: ignore[index]
    assert len({site for site, _ in families}) == 4
    assert all(s == {"train", "heldout"} for s in families.values())
    # Each task has its own seeded copy of its site: no two ask the same with the same answer.
    assert len({json.dumps([t.instruction, t.verifier.kwargs]) for t in TASKS}) == len(TASKS)  # type: ignore[union-attr]
    assert load_tasks("web-basic") == TASKS  # deterministic


@pytest.mark.parametrize("task_id", sorted(BY_ID))
def test_every_task_is_solvable_and_scores_zero_untouched(task_id: str, tmp_path: Path) -> None:
    task = BY_ID[task_id]
    client = _site(task, tmp_path)
    _ok(client.get("/"))
    assert _score(task, tmp_path) == 0.0
    solve_over_http(task, client, tmp_path)
    verdict = run_python_verifier(task.verifier, tmp_path)  # type: ignore[arg-type]
    assert verdict.reward == 1.0, verdict.details
    if task.verifier.kwargs["kind"] == "answer":  # type: ignore[union-attr]
        _answer(tmp_path, "I could not find it")
        assert _score(task, tmp_path) == 0.0
        _answer(tmp_path, task.verifier.kwargs["expected"], stopped="max_steps")  # type: ignore[union-attr]
        assert _score(task, tmp_path) == 0.0


def test_seeding_is_deterministic_and_differs_by_seed(tmp_path: Path) -> None:
    def dump(site: str, seed: int, name: str) -> list[str]:
        build_app(site, tmp_path / name, seed=seed)
        with sqlite3.connect(tmp_path / name) as db:
            return list(db.iterdump())

    for site in ("shop", "booking", "wiki", "settings"):
        assert dump(site, 7, f"{site}-a.db") == dump(site, 7, f"{site}-b.db")
        assert dump(site, 7, f"{site}-a.db") != dump(site, 8, f"{site}-c.db")


# -- the sites and their verifiers -------------------------------------------------------------------
def test_shop_cart_checkout_and_order_checks(tmp_path: Path) -> None:
    client = TestClient(build_app("shop", tmp_path / STATE_FILE, seed=1))
    products = shop.catalog(1)
    a, b = products[0], products[1]
    _ok(client.post("/cart/add", data={"product_id": a.id}))
    _ok(client.post("/cart/add", data={"product_id": a.id}))
    _ok(client.post("/cart/add", data={"product_id": b.id}))
    assert "Cart (3)" in _ok(client.get("/cart")).text
    _ok(client.post("/cart/update", data={"product_id": b.id, "op": "remove"}))
    _ok(client.post("/cart/update", data={"product_id": a.id, "op": "dec"}))
    assert "Cart (1)" in _ok(client.get("/cart")).text
    r = client.post("/checkout", data={"name": "  ", "shipping": "express"})
    assert r.status_code == 400 and "Please enter your name" in r.text
    r = client.post("/checkout", data={"name": "Ada", "shipping": "by pigeon"})
    assert r.status_code == 400 and "shipping option" in r.text
    page = _ok(client.post("/checkout", data={"name": "Ada Moreau", "shipping": "express"}))
    assert "Thank you, Ada Moreau!" in page.text and shop.money(a.price_cents + 700) in page.text
    assert "Cart (0)" in page.text
    want = {"kind": "order", "items": {a.name: 1}, "shipping": "express", "name": "ada moreau"}
    assert check(tmp_path, **want)["reward"] == 1.0  # names in any case
    assert check(tmp_path, **{**want, "items": {a.name: 2}})["reward"] == 0.0
    assert check(tmp_path, **{**want, "items": {a.name: 1, b.name: 1}})["reward"] == 0.0
    assert check(tmp_path, **{**want, "shipping": "standard"})["reward"] == 0.0
    assert check(tmp_path, **{**want, "name": "Ben Okafor"})["reward"] == 0.0
    r = client.post("/checkout", data={"name": "Ada Moreau", "shipping": "express"})
    assert r.status_code == 400 and "cart is empty" in r.text
    _ok(client.post("/cart/add", data={"product_id": a.id}))
    _ok(client.post("/checkout", data={"name": "Ada Moreau", "shipping": "express"}))
    verdict = check(tmp_path, **want)  # a second order is one too many
    assert verdict["reward"] == 0.0 and "2 orders" in verdict["reason"]


def test_booking_form_validates_every_field(tmp_path: Path) -> None:
    seed = 4
    client = TestClient(build_app("booking", tmp_path / STATE_FILE, seed=seed))
    w = booking.world(seed)
    dates = w.open_dates
    days = (w.today + datetime.timedelta(days=i) for i in range(1, 15))
    monday = next(d for d in days if d.weekday() == 0).isoformat()
    full_date, full_time = next(
        (b.date, b.time) for b in w.bookings if w.taken(b.date, b.time) >= booking.CAPACITY
    )
    good = {"name": "Ana Silva", "date": dates[1], "time": "18:00", "party": "4"}
    cases = {
        "Please enter a name": {"name": " "},
        "as YYYY-MM-DD": {"date": "next friday"},
        "closed on Mondays": {"date": monday},
        "We take bookings from": {"date": w.today.isoformat()},
        "Please choose a time": {"time": "18:15"},
        "fully booked": {"date": full_date, "time": full_time},
        "party size": {"party": "9"},
    }
    for message, change in cases.items():
        r = client.post("/book", data={**good, **change})
        assert r.status_code == 400 and message in r.text, (message, Page(r.text).text[:300])
    assert (
        check(tmp_path, kind="booking", name="Ana Silva", date=dates[1], time="18:00", party=4)["reward"]
        == 0.0
    )
    page = _ok(client.post("/book", data=good))
    assert "Table for 4" in page.text and "Ana Silva" in page.text
    assert ["Ana Silva"] == [r[2] for r in _ok(client.get("/bookings")).rows if r[2] == "Ana Silva"]
    want = {"kind": "booking", "name": "ana silva", "date": dates[1], "time": "18:00", "party": 4}
    assert check(tmp_path, **want)["reward"] == 1.0
    assert check(tmp_path, **{**want, "party": 3})["reward"] == 0.0
    assert check(tmp_path, **{**want, "time": "18:30"})["reward"] == 0.0


def test_wiki_search_edit_and_edit_checks(tmp_path: Path) -> None:
    seed = 2
    client = TestClient(build_app("wiki", tmp_path / STATE_FILE, seed=seed))
    pages = wiki.pages(seed)
    town, other = next(p for p in pages if p.kind == "town"), pages[-1]
    river = town.fact("River")
    hits = _ok(client.get("/search", params={"q": f"{river.upper()} river"})).links
    assert (f"/wiki/{town.slug}", town.title) in hits  # any case, every word, title or text
    assert client.get("/wiki/no-such-page").status_code == 404
    r = client.post(f"/wiki/{town.slug}/edit", data={"body": "  \n", "summary": ""})
    assert r.status_code == 400 and "cannot be empty" in r.text
    want = {"kind": "wiki_edit", "slug": town.slug, "facts": {"Population": "123450"}}
    assert check(tmp_path, **want)["reward"] == 0.0
    edited = town.body.replace(f"Population: {town.fact('Population')}", "Population: 123450")
    page = _ok(client.post(f"/wiki/{town.slug}/edit", data={"body": edited, "summary": "census"}))
    assert "Your changes were saved" in page.text and ["Population", "123450"] in page.rows
    assert check(tmp_path, **want)["reward"] == 1.0
    # A second fact changed on the way: not what was asked.
    _ok(client.post(f"/wiki/{town.slug}/edit", data={"body": edited.replace(river, "Nile"), "summary": ""}))
    assert "lost" in check(tmp_path, **want)["reason"]
    _ok(client.post(f"/wiki/{town.slug}/edit", data={"body": edited, "summary": ""}))
    _ok(client.post(f"/wiki/{other.slug}/edit", data={"body": other.body + "Vandalism.\n", "summary": ""}))
    assert "other pages" in check(tmp_path, **want)["reason"]
    appended = {"kind": "wiki_edit", "slug": other.slug, "append": "Vandalism."}
    assert check(tmp_path, **appended)["reward"] == 0.0  # the town page changed too
    _ok(client.post(f"/wiki/{town.slug}/edit", data={"body": town.body, "summary": "revert"}))
    assert check(tmp_path, **appended)["reward"] == 1.0
    with sqlite3.connect(tmp_path / STATE_FILE) as db:
        assert db.execute("SELECT COUNT(*) FROM revisions WHERE slug = ?", (town.slug,)).fetchone()[0] == 5


def test_settings_are_stored_only_on_save(tmp_path: Path) -> None:
    seed = 3
    client = TestClient(build_app("settings", tmp_path / STATE_FILE, seed=seed))
    before = settings.defaults(seed)
    form = _ok(client.get("/")).fields
    assert form["email"] == before["email"] and form["language"] == before["language"]
    language = next(lang for lang in settings.LANGUAGES if lang != before["language"])
    want = {"kind": "settings", "values": {"language": language}}
    assert check(tmp_path, **want)["reason"] == "the settings were never saved"
    r = client.post("/", data={**form, "language": language, "email": "not-an-address"})
    assert r.status_code == 400 and "valid email" in r.text
    assert check(tmp_path, **want)["reward"] == 0.0
    page = _ok(client.post("/", data={**form, "language": language}))
    assert "Settings saved." in page.text and page.fields["language"] == language
    assert check(tmp_path, **want)["reward"] == 1.0
    # Saving the form as shown again keeps it right; changing one thing more does not.
    _ok(client.post("/", data=page.fields))
    assert check(tmp_path, **want)["reward"] == 1.0
    _ok(
        client.post(
            "/", data={**page.fields, "theme": next(t for t in settings.THEMES if t != before["theme"])}
        )
    )
    assert "theme" in check(tmp_path, **want)["wrong"]


def test_answers_match_by_kind() -> None:
    assert matches("$12.50", "$12.50", "money") and matches("12.5", "$12.50", "money")
    assert matches("It costs $1,012.00.", "$1012.00", "money")
    assert not matches("$12.50 or $13.00", "$12.50", "money")
    assert matches("7:30 pm", "19:30", "time") and matches("19.30", "19:30", "time")
    assert not matches("19:00", "19:30", "time") and not matches("19:30 or 20:00", "19:30", "time")
    assert matches(' "1743." ', "1743", "number") and not matches("1742", "1743", "number")
    assert matches("Lou.Martin31@Example.com.", "lou.martin31@example.com", "text")
    assert not matches("lou.martin31@example.co", "lou.martin31@example.com", "text")


def test_a_verifier_without_state_or_answer_gives_zero(tmp_path: Path) -> None:
    assert "never ran" in check(tmp_path, kind="order", items={}, shipping="standard", name="x")["reason"]
    assert "no result file" in check(tmp_path, kind="answer", expected="1")["reason"]


def test_the_gui_harness_launch_and_eval_choice() -> None:
    task = BY_ID["web-shop-buy-one-0"]
    # All the launch asks of its sandbox.
    sandbox: Any = SimpleNamespace(tmpdir="/tmp", info=SimpleNamespace(backend="local"))

    def argv(task: Task, **kw: Any) -> list[str]:
        return asyncio.run(gui_harness(python="py", **kw)(task, "http://gw/r/1", "key", sandbox)).argv

    got = argv(task)
    assert got[:3] == ["py", "-m", "openforgerl.harnesses.gui"] and "--a11y" not in got
    assert got[got.index("--site") + 1] == "shop" and got[got.index("--max-steps") + 1] == "15"
    got = argv(task, max_steps=50, a11y=True)
    assert got[got.index("--max-steps") + 1] == "50" and "--a11y" in got
    web = task.model_copy(update={"harness_options": {"start_url": "https://example.org/", "max_steps": 100}})
    got = argv(web)
    assert (
        got[got.index("--start-url") + 1] == "https://example.org/"
        and got[got.index("--max-steps") + 1] == "100"
    )
    with pytest.raises(ValueError, match=r"harness_options\.site or start_url"):
        argv(task.model_copy(update={"harness_options": {}}))
    assert callable(harness_choice(EvalOptions(tasks="web-basic", harness="gui")))
    with pytest.raises(ValueError, match="unknown harness 'browser'; one of react, gui, claude-code"):
        harness_choice(EvalOptions(tasks="web-basic", harness="browser"))


def test_history_sends_at_most_k_screenshots_and_cuts_them_in_batches() -> None:
    history = History("system", keep_images=3)
    counts = []
    for step in range(8):
        history.observe(
            b"png%d" % step,
            f"Task: t\nStep {step + 1}" if step == 0 else f"Step {step + 1}",
            f"[shot {step}]",
        )
        counts.append(sum(isinstance(m["content"], list) for m in history.messages))
        history.messages.append({"role": "assistant", "content": "ok"})
    assert counts == [1, 2, 3, 1, 2, 3, 1, 2]
    # Between cuts each prompt extends the one before (the gateway can merge those calls).
    texts = [m["content"] for m in history.messages if isinstance(m["content"], str) and m["role"] == "user"]
    assert texts == ["[shot 0]", "[shot 1]", "[shot 2]", "[shot 3]", "[shot 4]", "[shot 5]"]


def test_eval_cli_offers_the_gui_harness() -> None:
    from click.testing import CliRunner

    from openforgerl.cli import main as cli

    assert "gui" in CliRunner().invoke(cli, ["eval", "--help"]).output
    bad = CliRunner().invoke(cli, ["eval", "--tasks", "web-basic", "--harness", "browser"])
    assert bad.exit_code == 2 and "unknown harness 'browser'; one of react, gui, " in bad.output


# -- the GUI harness in a sandbox, through a real browser ------------------------------------------------
CONTROL = re.compile(r'^- (\w+) "((?:[^"\\]|\\.)*)"(.*) at \((\d+), (\d+)\)$', re.M)
PAGE = re.compile(r"^Step (\d+) of (\d+)\. Page: .* \((\S*)\)$", re.M)
Action = tuple[str, dict[str, Any]]


class Observation:
    """What the scripted policy reads: the page's path and the controls `--a11y` lists."""

    def __init__(self, text: str) -> None:
        self.text = text
        m = PAGE.search(text)
        assert m, text[:300]
        self.path = m.group(3)
        self.controls = [
            (r, json.loads(f'"{n}"'), s, int(x), int(y)) for r, n, s, x, y in CONTROL.findall(text)
        ]

    def find(self, role: str, name: str | Callable[[str], bool]) -> tuple[str, int, int] | None:
        for r, n, state, x, y in self.controls:
            if r == role and (name(n) if callable(name) else n == name):
                return state, x, y
        return None

    def click(self, role: str, name: str | Callable[[str], bool]) -> Action:
        found = self.find(role, name)
        if found is None:  # below the fold
            return "scroll", {"dy": 300}
        return "click", {"x": found[1], "y": found[2]}

    def fill(self, label: str, value: str) -> Action | None:
        """The next action to make text field `label` hold `value`, or None once it does."""
        found = self.find("textbox", label)
        assert found is not None, (label, self.text[-800:])
        state = found[0]
        if f"value={json.dumps(value)}" in state:
            return None
        if "focused" not in state:
            return "click", {"x": found[1], "y": found[2]}
        return "type", {"text": value}


class ScriptedPolicy:
    """A SCRIPTED stand-in for a model, per task: it reads the observation and does the next step of
    a fixed plan (a test device: it proves the harness, browser, sites and verifiers fit together)."""

    def __init__(self, task: Task, sabotage: bool) -> None:
        self.task, self.sabotage = task, sabotage
        kw = task.verifier.kwargs  # type: ignore[union-attr]
        self.kw = kw
        self.to_add = [name for name, qty in kw.get("items", {}).items() for _ in range(qty)]
        self.clicked: set[str] = set()

    def __call__(self, obs: Observation) -> Action:
        family = self.task.metadata["family"]
        return getattr(self, f"_{self.task.metadata['site']}")(obs, family)

    def _shop(self, obs: Observation, family: str) -> Action:
        if obs.path.startswith("/order/"):
            return "answer", {"text": "done"}
        if obs.path == "/" or obs.path.startswith("/?"):
            if self.to_add:
                action = obs.click("button", f"Add {self.to_add[0]} to cart")
                if action[0] == "click":
                    self.to_add.pop(0)
                return action
            return obs.click("link", lambda n: n.startswith("Cart ("))
        if obs.path == "/cart":
            return obs.click("link", "Checkout")
        assert obs.path == "/checkout", obs.path
        fill = obs.fill("Name", self.kw["name"])
        if fill:
            return fill
        label = "Express (next day) +$7.00" if self.kw["shipping"] == "express" else "Standard (3-5 days)"
        state, x, y = obs.find("radio", label) or ("", 0, 0)
        if "unchecked" in state:
            return "click", {"x": x, "y": y}
        return obs.click("button", "Place order")

    def _booking(self, obs: Observation, family: str) -> Action:
        if obs.path.startswith("/booking/"):
            return "answer", {"text": "booked"}
        kw = self.kw
        for label, value in (("Name", kw["name"]), ("Date (YYYY-MM-DD)", kw["date"])):
            if fill := obs.fill(label, value):
                return fill
        wanted = self.task.metadata.get("asked_time", kw["time"])
        full = re.search(r"(\d\d:\d\d) on \S+ is fully booked", obs.text)
        if full:  # as the instruction says: the next later time
            wanted = booking.SLOTS[booking.SLOTS.index(full.group(1)) + 1]
        for role, name in (("radio", wanted), ("radio", f"{kw['party']} guests")):
            state = (obs.find(role, name) or ("unchecked", 0, 0))[0]
            if "unchecked" in state:
                return obs.click(role, name)
        return obs.click("button", "Book table")

    def _wiki(self, obs: Observation, family: str) -> Action:
        kw = self.kw
        if family == "append":
            if obs.path.endswith("?saved=1"):
                return "answer", {"text": "done"}
            if not obs.path.endswith("/edit"):
                return "navigate", {"url": f"/wiki/{kw['slug']}/edit"}
            state, x, y = obs.find("textbox", "Page text") or ("", 0, 0)
            if "focused" not in state and "end" not in self.clicked:
                return "click", {"x": x, "y": y}
            if "end" not in self.clicked:
                self.clicked.add("end")
                return "key", {"key": "Control+End"}
            if "typed" not in self.clicked:
                self.clicked.add("typed")
                return "type", {"text": "\n" + kw["append"]}
            return obs.click("button", "Save page")
        title = re.search(r"was (.+?) (?:founded|born)|is (.+?),", self.task.instruction)
        assert title is not None
        name = title.group(1) or title.group(2)
        if obs.path == "/":
            return obs.fill("Search the wiki", name) or ("key", {"key": "Enter"})
        if obs.path.startswith("/search"):
            return obs.click("link", name)
        fact = re.search(r'row "(?:Founded|Born|Height|Depth) (\d+)', obs.text)
        assert fact, obs.text[:1500]
        value = int(fact.group(1)) + (1 if self.sabotage else 0)  # sabotage: a wrong answer
        return "answer", {"text": str(value)}

    def _settings(self, obs: Observation, family: str) -> Action:
        if obs.path.endswith("?saved=1"):
            return "answer", {"text": "done"}
        if family == "switch":
            label = settings.TOGGLES[next(iter(self.kw["values"]))]
            if label not in self.clicked:
                self.clicked.add(label)
                return obs.click("checkbox", label)
            # sabotage: done without pressing Save, so nothing is stored
            return ("answer", {"text": "done"}) if self.sabotage else obs.click("button", "Save settings")
        language = self.kw["values"]["language"]
        state, x, y = obs.find("option", language) or ("", 0, 0)
        if "selected" not in state:
            return "click", {"x": x, "y": y}
        return obs.click("button", "Save settings")


class FakeGateway:
    """The runner's side of a gateway (rollouts with keys) and an OpenAI-compatible chat endpoint
    answered by a policy per rollout; every request body is kept for the test to inspect."""

    def __init__(self, policies: Callable[[str], Callable[[list[Any]], Any]]) -> None:
        self.make_policy = policies
        self.rollouts: dict[str, dict[str, Any]] = {}
        self.requests: dict[str, list[Any]] = collections.defaultdict(list)
        self.closed: dict[str, Any] = {}
        self.errors: list[str] = []
        self._ids = itertools.count()
        self.app = Starlette(
            routes=[
                Route("/admin/rollouts", self._create, methods=["POST"]),
                Route("/admin/rollouts/{rid}/close", self._close, methods=["POST"]),
                Route("/r/{rid}/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    async def _create(self, request: Request) -> JSONResponse:
        body = await request.json()
        rid = f"ro{next(self._ids)}"
        self.rollouts[rid] = {
            "task_id": body["task_id"],
            "key": f"key-{rid}",
            "policy": self.make_policy(body["task_id"]),
        }
        return JSONResponse({"rollout_id": rid, "api_key": f"key-{rid}"})

    async def _close(self, request: Request) -> JSONResponse:
        self.closed[request.path_params["rid"]] = await request.json()
        return JSONResponse({})

    async def _chat(self, request: Request) -> JSONResponse:
        rollout = self.rollouts[request.path_params["rid"]]
        assert request.headers["authorization"] == f"Bearer {rollout['key']}"
        body = await request.json()
        self.requests[request.path_params["rid"]].append(body)
        try:
            reply = rollout["policy"](body["messages"])
        except Exception as exc:  # the test reports it; the harness sees a server error
            self.errors.append(f"{request.path_params['rid']} ({rollout['task_id']}): {exc!r}")
            return JSONResponse({"error": {"message": repr(exc)}}, status_code=400)
        n = len(self.requests[request.path_params["rid"]])
        if isinstance(reply, str):  # text, no tool call
            message: dict[str, Any] = {"role": "assistant", "content": reply}
        else:
            calls = reply if isinstance(reply, list) else [reply]
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{n}_{i}",
                        "type": "function",
                        "function": {
                            "name": name,
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                    for i, (name, args) in enumerate(calls)
                ],
            }
        return JSONResponse(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@pytest.fixture
def fake_gateway() -> Iterator[Callable[[Callable[[str], Any]], tuple[FakeGateway, str]]]:
    import uvicorn

    from openforgerl.testing.gateway import free_port

    servers: list[tuple[Any, threading.Thread]] = []

    def start(policies: Callable[[str], Any]) -> tuple[FakeGateway, str]:
        gw = FakeGateway(policies)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(gw.app, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the fake gateway did not start"
            time.sleep(0.05)
        servers.append((server, thread))
        return gw, f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def _needs_chromium() -> None:
    pytest.importorskip("playwright.sync_api")
    if not os.access("/usr/bin/chromium", os.X_OK):
        pytest.skip("no Chromium at /usr/bin/chromium (make test-ui installs Debian's)")


def _observation(messages: list[Any]) -> tuple[Observation, list[bytes]]:
    """The newest observation's text, and the PNGs of every image in the prompt."""
    images = [
        base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part["type"] == "image_url"
    ]
    last = messages[-1]
    assert last["role"] == "user"
    text = next(p["text"] for p in last["content"] if p["type"] == "text")
    return Observation(text), images


def _png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG"
        return im.size


SOLVED = ["web-shop-buy-two-1", "web-booking-book-fallback-0", "web-wiki-year-0", "web-wiki-append-2",
          "web-settings-language-1"]  # fmt: skip
SABOTAGED = ["web-settings-switch-0", "web-wiki-measure-2"]


@pytest.mark.ui
def test_a_scripted_policy_solves_and_fails_tasks_through_the_runner(
    fake_gateway: Callable[[Callable[[str], Any]], tuple[FakeGateway, str]], tmp_path: Path
) -> None:
    _needs_chromium()
    sizes: list[tuple[int, int]] = []

    def policy_for(task_id: str) -> Callable[[list[Any]], Action]:
        script = ScriptedPolicy(BY_ID[task_id], sabotage=task_id in SABOTAGED)

        def step(messages: list[Any]) -> Action:
            obs, images = _observation(messages)
            assert 1 <= len(images) <= 3  # older screenshots are sent as text
            sizes.append(_png_size(images[-1]))
            return script(obs)

        return step

    gw, url = fake_gateway(policy_for)
    tasks = [BY_ID[t] for t in SOLVED + SABOTAGED]
    cfg = RunnerConfig(
        gateway_url=url, admin_token="test", run_id="web", state_path=tmp_path / "runner.db", concurrency=2
    )

    async def go() -> Any:
        runner = Runner(cfg, LocalBackend(), gui_harness(a11y=True))
        try:
            return await runner.run(tasks)
        finally:
            await runner.close()

    results = {r.task_id: r for r in asyncio.run(go())}
    assert gw.errors == []
    report = {
        t: (r.status, r.outcome, r.reward, r.details.get("verifier"), r.details["harness"]["tail"][-600:])
        for t, r in results.items()
    }
    for task_id in SOLVED:
        status, outcome, reward, _, tail = report[task_id]
        assert (status, outcome, reward) == (Status.DONE, "ok", 1.0), f"{task_id}: {tail}"  # with its errors
        assert json.loads(tail.strip().splitlines()[-1])["stopped"] == "answered"
    settings_verdict, wiki_verdict = report[SABOTAGED[0]][3], report[SABOTAGED[1]][3]
    assert (
        report[SABOTAGED[0]][:3] == (Status.DONE, "ok", 0.0) and "never saved" in settings_verdict["reason"]
    )
    assert (
        report[SABOTAGED[1]][:3] == (Status.DONE, "ok", 0.0)
        and wiki_verdict["reason"] == "the answer is wrong"
    )
    assert set(sizes) == {(640, 480)}
    assert {c["reward"] for c in gw.closed.values()} == {0.0, 1.0} and len(gw.closed) == len(tasks)
    seconds = [
        json.loads(r.details["harness"]["tail"].strip().splitlines()[-1])["seconds"] for r in results.values()
    ]
    steps = sum(len(v) for v in gw.requests.values())
    print(f"\n{steps} steps in {len(tasks)} sandboxes; per rollout: {seconds}")


@pytest.mark.ui
def test_bad_actions_and_the_step_limit_end_the_loop_cleanly(
    fake_gateway: Callable[[Callable[[str], Any]], tuple[FakeGateway, str]], tmp_path: Path
) -> None:
    _needs_chromium()
    task = BY_ID["web-shop-buy-one-0"]
    url = ""
    bad: list[Any] = [
        "I think I should click the first product.",  # no tool call
        [("scroll", {"dy": 200}), ("scroll", {"dy": 200})],  # two calls: the first is done
        ("fly", {"to": "cart"}),
        ("click", {"x": "left", "y": 3}),
        ("click", {"x": 9999, "y": 5}),
        ("type", {"text": "hello"}),  # nothing has the focus
        ("key", {"key": "NoSuchKey"}),
        ("navigate", {"url": "GATEWAY/admin/rollouts"}),  # the browser never reaches the gateway
        ("click", "{oops"),  # arguments that are not JSON
        ("scroll", {"dy": -200}),  # the last step: its outcome goes to no one
    ]
    script = iter(bad)

    def policy_for(task_id: str) -> Callable[[list[Any]], Any]:
        def step(messages: list[Any]) -> Any:
            reply = next(script)
            if isinstance(reply, tuple) and reply[0] == "navigate":
                return "navigate", {"url": url + "/admin/rollouts"}
            return reply

        return step

    gw, url = fake_gateway(policy_for)
    spec = SandboxSpec(
        files=dict(task.files),  # type: ignore[arg-type]
        limits=Limits(memory_bytes=2 << 30, cpus=1.0, pids=512),
        network="gateway",
        gateway_url=url,
        ro_binds=python_binds(),
    )

    async def go() -> tuple[Any, dict[str, bytes]]:
        async with LocalBackend().create(spec, "web-bad-actions") as sandbox:
            ro = {"rollout_id": "ro0"}
            gw.rollouts["ro0"] = {"task_id": task.id, "key": "k", "policy": policy_for(task.id)}
            launch = await gui_harness(max_steps=len(bad))(
                task, f"{sandbox.gateway_url}/r/{ro['rollout_id']}", "k", sandbox
            )
            for path, content in launch.files.items():
                await sandbox.put_file(path, content)
            ran = await sandbox.exec(launch.argv, env=launch.env, timeout=300)
            names = [f".openforge/gui/step-{i:03d}.png" for i in range(len(bad) + 1)] + [RESULT_FILE]
            return ran, {n: await sandbox.get_file(n) for n in names}

    ran, files = asyncio.run(go())
    assert ran.exit_code == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    printed = json.loads(ran.stdout.strip().splitlines()[-1])
    result = json.loads(files.pop(RESULT_FILE))
    assert printed == result
    assert (result["stopped"], result["steps"], result["answer"]) == ("max_steps", len(bad), None)
    assert (result["invalid_actions"], result["actions"]) == (len(bad) - 2, 2)
    assert all(_png_size(png) == (640, 480) for png in files.values())  # the last one: the final page
    requests = gw.requests["ro0"]
    assert len(requests) == len(bad)
    final = requests[-1]["messages"]
    said = "\n".join(
        m["content"] if isinstance(m["content"], str) else " ".join(p.get("text", "") for p in m["content"])
        for m in final
        if m["role"] in ("tool", "user") and m.get("content")
    )
    for expected in [
        "Invalid action: no tool call",
        "scrolled by 200",
        "Ignored: one action per step.",
        "unknown tool 'fly'",
        "x must be a number",
        "(9999, 5) is off the screen",
        "nothing to type into",
        "unknown key 'NoSuchKey'",
        "/admin/rollouts is not part of this site",
        "Invalid action: Expecting property name",
    ]:
        assert expected in said, expected
    # Screenshots beyond the newest three went out as text, in batches (see gui_agent.History).
    images = [sum(1 for m in r["messages"] if isinstance(m.get("content"), list)) for r in requests]
    assert images == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1] and "[screenshot of / at step 1]" in said
    assert said.startswith(f"Task: {task.instruction}")  # the task outlives its screenshot
