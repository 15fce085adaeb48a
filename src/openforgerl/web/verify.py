"""The web-basic verifiers: they read the site's state (and the harness's answer) after a rollout.

`check(workdir, kind, **expected)` is the task's Python verifier; `workdir` is the rollout's final
work directory, copied out of the sandbox. Kinds:

- ``order``: exactly one order was placed, with exactly `items` ({product: quantity}), `shipping`
  and `name` (any case);
- ``booking``: exactly one booking was made (the seeded ones aside), with `name`, `date`, `time` and
  `party`;
- ``settings``: the settings were saved, and every saved value is the seeded one except `values`,
  which hold the asked ones;
- ``wiki_edit``: the page `slug` has the facts `facts` ({key: value}) and/or ends with `append`, and
  nothing else changed on it or on any other page;
- ``answer``: the harness answered (`.openforge/gui/result.json`) and the answer matches `expected`
  by `match`: ``text`` (any case, surrounding quotes and a final full stop ignored), ``number``,
  ``money`` or ``time`` (the answer's only number / amount / time of day is the expected one).

Each returns {"reward": 0.0 or 1.0, "reason": ...} so a failed rollout says why.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openforgerl.web import STATE_FILE
from openforgerl.web.common import seed_of

RESULT_FILE = ".openforge/gui/result.json"
Verdict = dict[str, Any]


def _verdict(ok: bool, reason: str, **details: Any) -> Verdict:
    return {"reward": 1.0 if ok else 0.0, "reason": reason, **details}


def _same_name(a: str, b: str) -> bool:
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def _order(db: sqlite3.Connection, items: dict[str, int], shipping: str, name: str) -> Verdict:
    orders = db.execute("SELECT * FROM orders ORDER BY id").fetchall()
    if len(orders) != 1:
        return _verdict(False, f"{len(orders)} orders placed, expected exactly one")
    order = orders[0]
    got = {
        r["name"]: r["qty"]
        for r in db.execute("SELECT name, qty FROM order_items WHERE order_id = ?", (order["id"],))
    }
    details = {"items": got, "shipping": order["shipping"], "name": order["name"]}
    if got != items:
        return _verdict(False, f"the order holds {got}, expected {items}", **details)
    if order["shipping"] != shipping:
        return _verdict(False, f"shipping {order['shipping']!r}, expected {shipping!r}", **details)
    if not _same_name(order["name"], name):
        return _verdict(False, f"ordered under {order['name']!r}, expected {name!r}", **details)
    return _verdict(True, "the order is right", **details)


def _booking(db: sqlite3.Connection, name: str, date: str, time: str, party: int) -> Verdict:
    new = db.execute("SELECT name, date, time, party FROM bookings WHERE seeded = 0 ORDER BY id").fetchall()
    if len(new) != 1:
        return _verdict(
            False, f"{len(new)} bookings made, expected exactly one", bookings=[dict(r) for r in new]
        )
    got = dict(new[0])
    want = {"name": name, "date": date, "time": time, "party": party}
    wrong = [k for k in want if (not _same_name(got[k], name) if k == "name" else got[k] != want[k])]
    if wrong:
        return _verdict(False, f"wrong {', '.join(wrong)}: booked {got}, expected {want}", booking=got)
    return _verdict(True, "the booking is right", booking=got)


def _settings(db: sqlite3.Connection, values: dict[str, str]) -> Verdict:
    from openforgerl.web.settings import current, defaults

    saves = db.execute("SELECT COUNT(*) FROM saves").fetchone()[0]
    if saves == 0:
        return _verdict(False, "the settings were never saved")
    want = defaults(seed_of(db)) | values
    got = current(db)
    wrong = {k: {"saved": got.get(k), "expected": v} for k, v in want.items() if got.get(k) != v}
    if wrong:
        return _verdict(False, f"wrong settings: {sorted(wrong)}", wrong=wrong, saves=saves)
    return _verdict(True, "the settings are right", saves=saves)


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _wiki_edit(
    db: sqlite3.Connection, slug: str, facts: dict[str, str] | None = None, append: str | None = None
) -> Verdict:
    from openforgerl.web.wiki import pages, split_body

    if (facts is None) == (append is None):
        raise ValueError("a wiki_edit check takes either facts or append")
    seeded = {p.slug: p.body for p in pages(seed_of(db))}
    now = {r["slug"]: r["body"] for r in db.execute("SELECT slug, body FROM pages")}
    others = sorted(s for s in seeded if s != slug and _collapse(now.get(s, "")) != _collapse(seeded[s]))
    if others:
        return _verdict(False, f"other pages changed too: {others}")
    before, after = seeded[slug], now.get(slug, "")
    if append is not None:
        # On a line of its own or after the last sentence: both read as "added at the end".
        if _collapse(after) != _collapse(before + " " + append):
            return _verdict(False, "the page is not its old text followed by the sentence", text=after[-500:])
        return _verdict(True, "the sentence is added")
    assert facts is not None
    got = dict(split_body(after)[0])
    wrong = {k: got.get(k) for k, v in facts.items() if _collapse(got.get(k, "")) != _collapse(v)}
    if wrong:
        return _verdict(False, f"facts not as asked: {wrong}, expected {facts}", text=after[-500:])
    # Every other line of the page must still be there, unchanged.
    edited = {k.casefold() for k in facts}
    keep = Counter(
        _collapse(line)
        for line in before.split("\n")
        if line.strip() and line.partition(":")[0].strip().casefold() not in edited
    )
    lost = keep - Counter(_collapse(line) for line in after.split("\n") if line.strip())
    if lost:
        return _verdict(False, f"other lines changed or lost: {sorted(lost)[:5]}", text=after[-500:])
    return _verdict(True, "the facts are edited")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_TIME = re.compile(r"\b(\d{1,2})[:.](\d{2})\s*([ap]\.?m\.?)?", re.I)


def _numbers(text: str) -> set[float]:
    out = set()
    for m in _NUMBER.finditer(text):
        raw = m.group().replace(",", "")
        try:
            out.add(float(raw))
        except ValueError:
            continue
    return out


def _times(text: str) -> set[str]:
    out = set()
    for h, m, ampm in _TIME.findall(text):
        hour = int(h) % 12 + (12 if ampm.lower().startswith("p") else 0) if ampm else int(h)
        out.add(f"{hour}:{m}")
    return out


def matches(answer: str, expected: str, match: str = "text") -> bool:
    """Whether an answer says `expected` (see the module's doc for the kinds of match)."""
    if match == "text":
        return _collapse(answer).strip(" \"'`.").casefold() == _collapse(expected).casefold()
    if match in ("number", "money"):
        return _numbers(answer.replace("$", " ")) == _numbers(expected.replace("$", " "))
    if match == "time":
        return _times(answer) == {expected}
    raise ValueError(f"unknown match {match!r}: text, number, money or time")


def _answer(workdir: Path, expected: str, match: str = "text") -> Verdict:
    path = workdir / RESULT_FILE
    if not path.is_file():
        return _verdict(False, "no answer: the harness wrote no result file")
    result = json.loads(path.read_text())
    answer = result.get("answer")
    if result.get("stopped") != "answered" or not isinstance(answer, str):
        return _verdict(False, f"no answer: the harness stopped ({result.get('stopped')})")
    ok = matches(answer, expected, match)
    return _verdict(
        ok, "the answer is right" if ok else "the answer is wrong", answer=answer[:200], expected=expected
    )


def check(workdir: Path, kind: str, **expected: Any) -> Verdict:
    """The task's verifier: `kind` names the check, `expected` its arguments (see the module)."""
    workdir = Path(workdir)
    if kind == "answer":
        return _answer(workdir, **expected)
    state = workdir / STATE_FILE
    if not state.is_file():
        return _verdict(False, f"no site state at {STATE_FILE}: the site never ran")
    # Read-write on purpose: this is a copy, and a journal left by a killed server must be rolled back.
    db = sqlite3.connect(state)
    db.row_factory = sqlite3.Row
    try:
        checks: dict[str, Callable[..., Verdict]] = {
            "order": _order,
            "booking": _booking,
            "settings": _settings,
            "wiki_edit": _wiki_edit,
        }
        if kind not in checks:
            raise ValueError(f"unknown check {kind!r}: {', '.join([*checks, 'answer'])}")
        return checks[kind](db, **expected)
    finally:
        db.close()
