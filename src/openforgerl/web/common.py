"""What the four sites share: the page layout and style, the state database, form parsing.

Pages are rendered on the server with Jinja2 (autoescaped) and use plain HTML forms: every action
is a click, some typing or a key press, and every state change is a POST that the server checks.
The style is made for a 640x480 screenshot read by a small vision model: 18 px text, 40 px tall
controls with thick borders, strong colours for the current choice, errors in a red box.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs

from jinja2 import DictLoader, Environment, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse
from starlette.routing import BaseRoute

CSS = """
* { box-sizing: border-box; }
body { margin: 0; font: 18px/1.35 "DejaVu Sans", "Liberation Sans", sans-serif; color: #111;
  background: #fff; }
header { display: flex; align-items: center; gap: 8px; height: 52px; padding: 0 10px;
  background: #1f4e8c; color: #fff; }
header .brand { font-size: 20px; font-weight: bold; margin-right: auto; }
header a { color: #fff; font-weight: bold; text-decoration: none; padding: 6px 10px;
  border: 2px solid #9fbbe0; border-radius: 6px; }
main { padding: 10px 14px 84px; max-width: 640px; }
h1 { font-size: 24px; margin: 4px 0 10px; }
h2 { font-size: 20px; margin: 12px 0 6px; }
p { margin: 6px 0; }
a { color: #1346a0; }
button, .button { display: inline-flex; align-items: center; font: inherit; font-weight: bold;
  min-height: 40px; padding: 6px 16px; border: 2px solid #1f4e8c; border-radius: 6px;
  background: #2a6fd1; color: #fff; cursor: pointer; text-decoration: none; }
button.secondary, .button.secondary { background: #fff; color: #1f4e8c; }
button.danger { background: #fff; color: #b00020; border-color: #b00020; }
input[type=text], input[type=search], textarea { font: inherit; width: 100%; min-height: 40px;
  padding: 6px 10px; border: 2px solid #555; border-radius: 6px; background: #fff; }
input:focus, textarea:focus, select:focus, button:focus { outline: 3px solid #f0a000; outline-offset: 1px; }
select { font: inherit; border: 2px solid #555; border-radius: 6px; padding: 2px; }
select[size] option { padding: 4px 8px; }
select[size] option:checked { background: #2a6fd1 linear-gradient(#2a6fd1, #2a6fd1); color: #fff; }
label.field { display: block; font-weight: bold; margin: 10px 0 4px; }
.hint { color: #444; font-size: 16px; }
.error { background: #fde2e2; border: 2px solid #b00020; color: #7a0014; padding: 8px 12px;
  border-radius: 6px; margin: 6px 0; }
.notice { background: #e1f5e1; border: 2px solid #2e7d32; color: #1b4d1e; padding: 8px 12px;
  border-radius: 6px; margin: 6px 0; }
.chips { display: flex; flex-wrap: wrap; gap: 6px; }
.chips label { display: inline-flex; align-items: center; gap: 6px; min-height: 40px; padding: 4px 12px;
  border: 2px solid #555; border-radius: 6px; cursor: pointer; }
.chips label:has(input:checked) { background: #2a6fd1; border-color: #1f4e8c; color: #fff;
  font-weight: bold; }
.chips label.full { border-style: dashed; color: #777; text-decoration: line-through; cursor: not-allowed; }
.chips input { width: 20px; height: 20px; margin: 0; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 2px solid #ddd; padding: 6px 6px; text-align: left; }
td.num, th.num { text-align: right; }
.row { display: flex; align-items: center; gap: 10px; }
ul.links { padding-left: 24px; }
ul.links a { display: inline-block; min-height: 36px; padding: 6px 8px; font-size: 20px; }
.actions { position: fixed; left: 0; right: 0; bottom: 0; height: 68px; display: flex; align-items: center;
  gap: 12px; padding: 0 14px; background: #eef3fa; border-top: 2px solid #9fbbe0; }
"""

BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }} - {{ brand }}</title>
<style>{{ css|safe }}</style></head>
<body><header><span class="brand">{{ brand }}</span>
{% for href, text in nav %}<a href="{{ href }}">{{ text }}</a>{% endfor %}</header>
<main>{% block main %}{% endblock %}</main></body></html>
"""


class SiteModule(Protocol):
    """What each site module provides (shop, booking, wiki, settings)."""

    NAME: str
    SCHEMA: str

    def seed_db(self, db: sqlite3.Connection, seed: int) -> None: ...

    def routes(self) -> list[BaseRoute]: ...


def templates(pages: Mapping[str, str]) -> Environment:
    """A Jinja environment holding the base layout and a site's pages (which extend "base")."""
    return Environment(
        loader=DictLoader({"base": BASE, **pages}),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(env: Environment, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(env.get_template(template).render(css=CSS, **context), status_code=status)


def redirect(url: str) -> RedirectResponse:
    # 303: the browser follows a form POST with a GET, so reloading the result never posts again.
    return RedirectResponse(url, status_code=303)


async def form(request: Request) -> dict[str, str]:
    """A urlencoded form body (the last value of each field).

    Parsed here rather than with request.form(), which needs the python-multipart package only for
    this; the sites post nothing but urlencoded forms.
    """
    body = (await request.body()).decode("utf-8", errors="replace")
    return {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}


@contextlib.contextmanager
def connect(path: str | Path, *, readonly: bool = False) -> Iterator[sqlite3.Connection]:
    """One connection per request: the sites are tiny and one browser uses them at a time.

    The rollback journal (not WAL) keeps the state a single file that the runner copies out of the
    sandbox while the server may already be gone.
    """
    uri = f"file:{Path(path)}?mode=ro" if readonly else str(path)
    db = sqlite3.connect(uri, uri=readonly, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        with db:
            yield db
    finally:
        db.close()


def db_path(request: Request) -> Path:
    return Path(request.app.state.db_path)


def create_state(site: SiteModule, path: Path, seed: int) -> None:
    """Create and seed the site's database (the same seed gives the same rows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)
    with connect(tmp) as db:
        db.executescript(site.SCHEMA)
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('site', ?), ('seed', ?)", (site.NAME, json.dumps(seed)))
        site.seed_db(db, seed)
    tmp.replace(path)  # a crash while seeding never leaves a half-seeded state behind


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def seed_of(db: sqlite3.Connection) -> int:
    """The seed the state was made from (sites that derive facts from it, like booking's "today")."""
    return int(json.loads(db.execute("SELECT value FROM meta WHERE key = 'seed'").fetchone()[0]))
