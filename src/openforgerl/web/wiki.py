"""The wiki: ten pages about made-up towns, mountains, lakes and people, search, and page editing.

A page's text starts with its facts, one `Key: Value` line each (shown as a table), then a little
prose that never repeats a fact (so an edited fact has one place to change).
Every fact is drawn from the seed, so no model knows it beforehand. State: `pages` (the current
text) and `revisions` (every saved text with its edit summary).
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from openforgerl.web.common import connect, db_path, form, redirect, render, templates

NAME = "wiki"
MAX_BODY = 20_000
FACT_LINE = re.compile(r"^([A-Z][A-Za-z ]{0,30}): (.+)$")
_ONSETS = ("B", "D", "F", "G", "K", "L", "M", "N", "P", "R", "S", "T", "V", "Z", "Br", "Kr", "St", "Th")
_RIMES = ("al", "en", "or", "an", "is", "ur", "el", "ar", "on", "ir")
_REGIONS = ("Eastern Hills", "North Coast", "Lake District", "High Plains", "Southern Valleys")
_THINGS = ("wool market", "clock tower", "cheese fair", "stone bridge", "glass works", "boat races")
_INVENTIONS = ("folding ladder", "tide clock", "pocket loom", "wind lantern", "rope brake", "salt press")
_FIRST = ("Alma", "Bruno", "Cora", "Dario", "Edda", "Felix", "Greta", "Hanno", "Ines", "Jakob")

SCHEMA = """
CREATE TABLE pages (slug TEXT PRIMARY KEY, title TEXT NOT NULL, body TEXT NOT NULL,
  revision INTEGER NOT NULL);
CREATE TABLE revisions (id INTEGER PRIMARY KEY, slug TEXT NOT NULL, body TEXT NOT NULL,
  summary TEXT NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class Page:
    title: str
    kind: str  # town | mountain | lake | person
    facts: tuple[tuple[str, str], ...]
    prose: str

    @property
    def slug(self) -> str:
        return slugify(self.title)

    @property
    def body(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.facts) + "\n\n" + self.prose + "\n"

    def fact(self, key: str) -> str:
        return dict(self.facts)[key]


def slugify(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _word(rng: random.Random, syllables: int = 2) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_RIMES) for _ in range(syllables)).capitalize()


def pages(seed: int) -> list[Page]:
    """The seeded wiki: 3 towns, 3 mountains, 2 lakes, 2 people, all with distinct names."""
    rng = random.Random(f"wiki-{seed}")
    used: set[str] = set()

    def name() -> str:
        while (w := _word(rng)) in used:
            pass
        used.add(w)
        return w

    out: list[Page] = []
    facts: tuple[tuple[str, str], ...]
    for _ in range(3):
        town, river = name(), name()
        founded, population = rng.randint(1100, 1950), rng.randint(8, 400) * 100
        region, thing = rng.choice(_REGIONS), rng.choice(_THINGS)
        facts = (("Type", "Town"), ("Region", region), ("Founded", str(founded)),
                 ("Population", str(population)), ("River", river))  # fmt: skip
        prose = f"{town} is a town on the {river} river.\n\nThe town is known for its {thing}."
        out.append(Page(town, "town", facts, prose))
    for _ in range(3):
        mountain, climber = f"Mount {name()}", f"{rng.choice(_FIRST)} {name()}"
        height, year = rng.randint(1200, 4800), rng.randint(1780, 1960)
        facts = (("Type", "Mountain"), ("Height", f"{height} m"), ("First climbed", str(year)),
                 ("First climbed by", climber))  # fmt: skip
        prose = f"{mountain} is a mountain.\n\nIts north face is steep; most walkers take the southern path."
        out.append(Page(mountain, "mountain", facts, prose))
    for _ in range(2):
        lake = f"Lake {name()}"
        depth, area = rng.randint(8, 320), rng.randint(2, 90)
        facts = (("Type", "Lake"), ("Depth", f"{depth} m"), ("Area", f"{area} km2"))
        prose = f"{lake} is a lake.\n\nSwimming is allowed in summer."
        out.append(Page(lake, "lake", facts, prose))
    for _ in range(2):
        person = f"{rng.choice(_FIRST)} {name()}"
        born, invention = rng.randint(1700, 1930), rng.choice(_INVENTIONS)
        hometown = out[rng.randrange(3)].title
        facts = (("Type", "Person"), ("Born", str(born)), ("Birthplace", hometown), ("Known for", invention))
        prose = f"{person} was an inventor.\n\nThey are best known for the {invention}."
        out.append(Page(person, "person", facts, prose))
    return out


def seed_db(db: sqlite3.Connection, seed: int) -> None:
    for p in pages(seed):
        db.execute("INSERT INTO pages VALUES (?,?,?,1)", (p.slug, p.title, p.body))
        db.execute("INSERT INTO revisions (slug, body, summary) VALUES (?,?,'created')", (p.slug, p.body))


def split_body(body: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(facts, paragraphs): the leading `Key: Value` lines, then the text split at blank lines."""
    lines = body.strip("\n").split("\n")
    facts: list[tuple[str, str]] = []
    while lines and (m := FACT_LINE.match(lines[0].strip())):
        facts.append((m.group(1), m.group(2)))
        lines.pop(0)
    paragraphs = [p.strip() for p in "\n".join(lines).split("\n\n") if p.strip()]
    return facts, paragraphs


PAGES = {
    "home": """{% extends "base" %}{% block main %}
<h1>Welcome to the Wiki</h1>
<form action="/search" class="row"><input type="search" name="q" aria-label="Search the wiki"
 placeholder="Search the wiki"><button>Search</button></form>
<h2>Featured pages</h2>
<ul class="links">{% for p in featured %}
<li><a href="/wiki/{{ p.slug }}">{{ p.title }}</a></li>{% endfor %}</ul>
{% endblock %}""",
    "search": """{% extends "base" %}{% block main %}
<form action="/search" class="row"><input type="search" name="q" value="{{ q }}" aria-label="Search the wiki"
 placeholder="Search the wiki"><button>Search</button></form>
{% if q %}<h2>{{ hits|length }} result{{ "s" if hits|length != 1 }} for "{{ q }}"</h2>{% endif %}
<ul class="links">{% for p in hits %}<li><a href="/wiki/{{ p.slug }}">{{ p.title }}</a></li>{% endfor %}</ul>
{% endblock %}""",
    "page": """{% extends "base" %}{% block main %}
{% if saved %}<p class="notice">Your changes were saved.</p>{% endif %}
<div class="row"><h1>{{ title }}</h1><a class="button secondary" href="/wiki/{{ slug }}/edit"
 aria-label="Edit {{ title }}">Edit</a></div>
{% if facts %}<table>{% for k, v in facts %}
<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>{% endif %}
{% for p in paragraphs %}<p>{{ p }}</p>{% endfor %}
{% endblock %}""",
    "edit": """{% extends "base" %}{% block main %}
<h1>Editing {{ title }}</h1>
{% for e in errors %}<p class="error">{{ e }}</p>{% endfor %}
<form method="post" action="/wiki/{{ slug }}/edit">
<textarea name="body" rows="9" aria-label="Page text" spellcheck="false">{{ body }}</textarea>
<label class="field" for="summary">Edit summary</label>
<input type="text" id="summary" name="summary" value="{{ summary }}" autocomplete="off">
<div class="actions"><button>Save page</button>
<a class="button secondary" href="/wiki/{{ slug }}">Cancel</a></div>
</form>{% endblock %}""",
    "missing": """{% extends "base" %}{% block main %}
<p class="error">There is no page called "{{ slug }}".</p>{% endblock %}""",
}
ENV = templates(PAGES)


def _page(template: str, status: int = 200, **context: object) -> Response:
    nav = [("/", "Home"), ("/search", "Search")]
    title = str(
        context.get("title") or {"home": "Home", "search": "Search", "missing": "Not found"}[template]
    )
    context.pop("title", None)
    return render(ENV, template, status=status, title=title, brand="Wiki", nav=nav, **context)


async def home(request: Request) -> Response:
    with connect(db_path(request)) as db:
        featured = db.execute("SELECT slug, title FROM pages ORDER BY rowid LIMIT 3 OFFSET 2").fetchall()
    return _page("home", featured=featured)


def search_pages(db: sqlite3.Connection, q: str) -> list[sqlite3.Row]:
    """Pages whose title or text holds every word of the query (any case)."""
    words = q.lower().split()
    if not words:
        return []
    rows = db.execute("SELECT slug, title, body FROM pages ORDER BY title").fetchall()
    return [r for r in rows if all(w in (r["title"] + "\n" + r["body"]).lower() for w in words)]


async def search(request: Request) -> Response:
    q = request.query_params.get("q", "").strip()
    with connect(db_path(request)) as db:
        hits = search_pages(db, q)
    return _page("search", q=q, hits=hits)


def _requested_page(request: Request) -> tuple[str, sqlite3.Row | None]:
    """The slug in the path and its page's row (None where there is no such page)."""
    slug = request.path_params["slug"]
    with connect(db_path(request)) as db:
        return slug, db.execute("SELECT * FROM pages WHERE slug = ?", (slug,)).fetchone()


async def view(request: Request) -> Response:
    slug, row = _requested_page(request)
    if row is None:
        return _page("missing", status=404, slug=slug)
    facts, paragraphs = split_body(row["body"])
    saved = request.query_params.get("saved") == "1"
    return _page("page", title=row["title"], slug=slug, facts=facts, paragraphs=paragraphs, saved=saved)


async def edit_form(request: Request) -> Response:
    slug, row = _requested_page(request)
    if row is None:
        return _page("missing", status=404, slug=slug)
    return _page("edit", title=row["title"], slug=slug, body=row["body"], summary="", errors=[])


async def save(request: Request) -> Response:
    slug = request.path_params["slug"]
    data = await form(request)
    body = data.get("body", "").replace("\r\n", "\n")
    summary = data.get("summary", "").strip()
    with connect(db_path(request)) as db:
        row = db.execute("SELECT * FROM pages WHERE slug = ?", (slug,)).fetchone()
        if row is None:
            return _page("missing", status=404, slug=slug)
        errors = []
        if not body.strip():
            errors.append("The page text cannot be empty.")
        elif len(body) > MAX_BODY:
            errors.append(f"The page text is too long ({MAX_BODY} characters at most).")
        if errors:
            return _page(
                "edit", status=400, title=row["title"], slug=slug, body=body, summary=summary, errors=errors
            )
        db.execute("UPDATE pages SET body = ?, revision = revision + 1 WHERE slug = ?", (body, slug))
        db.execute("INSERT INTO revisions (slug, body, summary) VALUES (?,?,?)", (slug, body, summary))
    return redirect(f"/wiki/{slug}?saved=1")


def routes() -> list[BaseRoute]:
    return [
        Route("/", home),
        Route("/search", search),
        Route("/wiki/{slug}", view),
        Route("/wiki/{slug}/edit", edit_form),
        Route("/wiki/{slug}/edit", save, methods=["POST"]),
    ]
