"""The booking form: a restaurant's table bookings (name, date, time, party size), with validation.

Bookings open from tomorrow for two weeks (the site's "today" comes from the seed), never on a
Monday (closed), at ten half-hour times from 17:00, for 1 to 8 guests, at most `CAPACITY` bookings
per time; some times are fully booked by the seeded bookings. State: `bookings` (seeded rows carry
seeded = 1; the verifier looks at the others).
"""

from __future__ import annotations

import datetime as dt
import random
import sqlite3
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from openforgerl.web.common import connect, db_path, form, redirect, render, seed_of, templates

NAME = "booking"
SLOTS = tuple(f"{h}:{m}" for h in range(17, 22) for m in ("00", "30"))
PARTY_SIZES = tuple(range(1, 9))
CAPACITY = 2
OPEN_DAYS = 14
_RESTAURANTS = ("Trattoria Sole", "The Green Fig", "Harbour Kitchen", "Maison Lune", "Copper Pot")
_GUESTS = (
    "Ada Moreau", "Ben Okafor", "Clara Voss", "Dev Patel", "Elif Demir", "Finn Larsen", "Grace Liu",
    "Hugo Brandt", "Iris Novak", "Jonas Berg", "Kira Tanaka", "Leo Fischer", "Mia Rossi", "Nora Haddad",
    "Omar Aziz", "Paula Reyes", "Quinn Walsh", "Rosa Lind",
)  # fmt: skip

SCHEMA = """
CREATE TABLE bookings (id INTEGER PRIMARY KEY, name TEXT NOT NULL, date TEXT NOT NULL, time TEXT NOT NULL,
  party INTEGER NOT NULL, seeded INTEGER NOT NULL DEFAULT 0);
"""


@dataclass(frozen=True, slots=True)
class Booking:
    name: str
    date: str
    time: str
    party: int


@dataclass(frozen=True, slots=True)
class World:
    restaurant: str
    today: dt.date
    bookings: tuple[Booking, ...]

    @property
    def open_dates(self) -> list[str]:
        days = (self.today + dt.timedelta(days=i) for i in range(1, OPEN_DAYS + 1))
        return [d.isoformat() for d in days if d.weekday() != 0]

    def taken(self, date: str, time: str) -> int:
        return sum(1 for b in self.bookings if b.date == date and b.time == time)


def world(seed: int) -> World:
    """The seeded restaurant: its name, its today, and 12 bookings (three times booked out)."""
    rng = random.Random(f"booking-{seed}")
    today = dt.date(2025, 6, 2) + dt.timedelta(days=rng.randrange(28))
    restaurant = rng.choice(_RESTAURANTS)
    partial = World(restaurant, today, ())
    dates = partial.open_dates
    names = iter(rng.sample(_GUESTS, 12))
    bookings: list[Booking] = []
    for _ in range(3):  # full times: CAPACITY bookings each
        date, time = rng.choice(dates), rng.choice(SLOTS[2:-2])
        while any(b.date == date and b.time == time for b in bookings):
            date, time = rng.choice(dates), rng.choice(SLOTS[2:-2])
        bookings += [Booking(next(names), date, time, rng.randint(2, 6)) for _ in range(CAPACITY)]
    while len(bookings) < 12:
        date, time = rng.choice(dates), rng.choice(SLOTS)
        if not any(b.date == date and b.time == time for b in bookings):
            bookings.append(Booking(next(names), date, time, rng.randint(1, 8)))
    return World(restaurant, today, tuple(sorted(bookings, key=lambda b: (b.date, b.time, b.name))))


def seed_db(db: sqlite3.Connection, seed: int) -> None:
    rows = [(b.name, b.date, b.time, b.party) for b in world(seed).bookings]
    db.executemany("INSERT INTO bookings (name, date, time, party, seeded) VALUES (?,?,?,?,1)", rows)


def long_date(iso: str) -> str:
    return dt.date.fromisoformat(iso).strftime("%a %d %b %Y")


PAGES = {
    "form": """{% extends "base" %}{% block main %}
{% if errors %}<div class="error">{% for e in errors %}<div>{{ e }}</div>{% endfor %}</div>{% endif %}
<form method="post" action="/book">
<div class="row"><div style="flex:1"><label class="field" for="name">Name</label>
<input type="text" id="name" name="name" value="{{ v.name }}" autocomplete="off"></div>
<div style="flex:1"><label class="field" for="date">Date (YYYY-MM-DD)</label>
<input type="text" id="date" name="date" value="{{ v.date }}" placeholder="YYYY-MM-DD"
 autocomplete="off"></div></div>
<p class="hint">Today is {{ today }}. Open Tuesday to Sunday, {{ first }} to {{ last }}.</p>
<label class="field">Time</label><div class="chips">
{% for s in slots %}<label{% if s in full %} class="full"{% endif %}>
<input type="radio" name="time" value="{{ s }}"
{% if s == v.time %} checked{% endif %}>{{ s }}</label>{% endfor %}</div>
<label class="field">Party size</label><div class="chips">
{% for n in sizes %}<label><input type="radio" name="party" value="{{ n }}"
 aria-label="{{ n }} guest{{ 's' if n > 1 }}"
{% if n|string == v.party %} checked{% endif %}>{{ n }}</label>{% endfor %}</div>
<div class="actions"><button>Book table</button></div>
</form>{% endblock %}""",
    "done": """{% extends "base" %}{% block main %}
<p class="notice">Booked! Table for {{ b.party }} on {{ when }} at {{ b.time }},
under the name {{ b.name }}.</p>
<p>Booking number {{ b.id }}.</p>
<p><a class="button secondary" href="/bookings">All bookings</a></p>{% endblock %}""",
    "list": """{% extends "base" %}{% block main %}
<h1>Bookings</h1>
<table><tr><th>Date</th><th>Time</th><th>Name</th><th class="num">Guests</th></tr>
{% for b in bookings %}<tr><td>{{ b.date }}</td><td>{{ b.time }}</td><td>{{ b.name }}</td>
<td class="num">{{ b.party }}</td></tr>{% endfor %}</table>{% endblock %}""",
}
ENV = templates(PAGES)


def _world(db: sqlite3.Connection) -> World:
    return world(seed_of(db))


def _page(template: str, db: sqlite3.Connection, status: int = 200, **context: object) -> Response:
    nav = [("/", "Book"), ("/bookings", "Bookings")]
    title = {"form": "Book a table", "done": "Booked", "list": "Bookings"}[template]
    return render(ENV, template, status=status, title=title, brand=_world(db).restaurant, nav=nav, **context)


def _form_page(db: sqlite3.Connection, values: dict[str, str], errors: list[str], full: set[str]) -> Response:
    w = _world(db)
    dates = w.open_dates
    return _page(
        "form",
        db,
        status=400 if errors else 200,
        v={k: values.get(k, "") for k in ("name", "date", "time", "party")},
        errors=errors,
        full=full,
        slots=SLOTS,
        sizes=PARTY_SIZES,
        today=long_date(w.today.isoformat()),
        first=dates[0],
        last=dates[-1],
    )


async def book_form(request: Request) -> Response:
    with connect(db_path(request)) as db:
        return _form_page(db, {}, [], set())


def _full_times(db: sqlite3.Connection, date: str) -> set[str]:
    rows = db.execute(
        "SELECT time FROM bookings WHERE date = ? GROUP BY time HAVING COUNT(*) >= ?", (date, CAPACITY)
    )
    return {r[0] for r in rows}


def validate(db: sqlite3.Connection, v: dict[str, str]) -> list[str]:
    w = _world(db)
    errors = []
    if not v.get("name", "").strip():
        errors.append("Please enter a name for the booking.")
    date = v.get("date", "").strip()
    try:
        day = dt.date.fromisoformat(date) if len(date) == 10 else None
    except ValueError:
        day = None
    dates = w.open_dates
    if day is None:
        errors.append(f"Please enter the date as YYYY-MM-DD, for example {dates[0]}.")
    elif day.weekday() == 0 and dates[0] <= date <= dates[-1]:
        errors.append("We are closed on Mondays.")
    elif date not in dates:
        errors.append(f"We take bookings from {dates[0]} to {dates[-1]}.")
    time = v.get("time", "")
    if time not in SLOTS:
        errors.append("Please choose a time.")
    elif day is not None and time in _full_times(db, date):
        errors.append(f"{time} on {date} is fully booked. Please choose another time.")
    if v.get("party", "") not in {str(n) for n in PARTY_SIZES}:
        errors.append("Please choose the party size (1 to 8 guests).")
    return errors


async def book(request: Request) -> Response:
    v = await form(request)
    with connect(db_path(request)) as db:
        errors = validate(db, v)
        if errors:
            return _form_page(db, v, errors, _full_times(db, v.get("date", "").strip()))
        booking_id = db.execute(
            "INSERT INTO bookings (name, date, time, party) VALUES (?,?,?,?)",
            (v["name"].strip(), v["date"].strip(), v["time"], int(v["party"])),
        ).lastrowid
    return redirect(f"/booking/{booking_id}")


async def done(request: Request) -> Response:
    with connect(db_path(request)) as db:
        b = db.execute("SELECT * FROM bookings WHERE id = ?", (request.path_params["id"],)).fetchone()
        if b is None:
            return _form_page(db, {}, ["No such booking."], set())
        return _page("done", db, b=b, when=long_date(b["date"]))


async def bookings(request: Request) -> Response:
    with connect(db_path(request)) as db:
        rows = db.execute("SELECT * FROM bookings ORDER BY date, time, name").fetchall()
        return _page("list", db, bookings=rows)


def routes() -> list[BaseRoute]:
    return [
        Route("/", book_form),
        Route("/book", book, methods=["POST"]),
        Route("/booking/{id:int}", done),
        Route("/bookings", bookings),
    ]
