"""The settings page: an account's profile, notifications, theme, language and list length.

Controls of every common kind: text fields, on/off switches (checkboxes), radio buttons, a list box
(`<select size=...>`, every choice visible) and a drop-down (`<select>`, changed with the arrow keys
or by typing). Nothing is stored until Save is pressed; a little script shows "Unsaved changes"
meanwhile. State: `settings` (key -> value) and `saves` (one row per successful save).
"""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from openforgerl.web.common import connect, db_path, form, redirect, render, templates

NAME = "settings"
TOGGLES = {
    "email_notifications": "Email notifications",
    "sms_notifications": "SMS notifications",
    "newsletter": "Monthly newsletter",
}
THEMES = {"light": "Light", "dark": "Dark", "system": "System"}
LANGUAGES = ("English", "Deutsch", "Español", "Français", "Italiano")
PAGE_SIZES = ("10", "25", "50", "100")
KEYS = ("display_name", "email", *TOGGLES, "theme", "language", "page_size")
_NAMES = ("Alex Romero", "Sam Keller", "Robin Haas", "Maya Singh", "Lou Martin", "Noa Berger", "Kai Jensen")
_DOMAINS = ("example.com", "mail.test", "inbox.example")

SCHEMA = """
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE saves (id INTEGER PRIMARY KEY, changed TEXT NOT NULL);
"""


def defaults(seed: int) -> dict[str, str]:
    """The seeded settings (toggles are "on"/"off")."""
    rng = random.Random(f"settings-{seed}")
    name = rng.choice(_NAMES)
    first, last = name.lower().split()
    values = {"display_name": name, "email": f"{first}.{last}{rng.randint(1, 99)}@{rng.choice(_DOMAINS)}"}
    values |= {key: rng.choice(("on", "off")) for key in TOGGLES}
    values |= {"theme": rng.choice(tuple(THEMES)), "language": rng.choice(LANGUAGES)}
    values["page_size"] = rng.choice(PAGE_SIZES)
    return values


def seed_db(db: sqlite3.Connection, seed: int) -> None:
    db.executemany("INSERT INTO settings VALUES (?,?)", list(defaults(seed).items()))


PAGES = {
    "form": """{% extends "base" %}{% block main %}
{% if saved %}<p class="notice">Settings saved.</p>{% endif %}
{% if errors %}<div class="error">{% for e in errors %}<div>{{ e }}</div>{% endfor %}</div>{% endif %}
<form method="post" action="/" id="settings">
<div class="row"><div style="flex:1"><label class="field" for="display_name">Display name</label>
<input type="text" id="display_name" name="display_name" value="{{ v.display_name }}"
 autocomplete="off"></div>
<div style="flex:1"><label class="field" for="email">Email</label>
<input type="text" id="email" name="email" value="{{ v.email }}" autocomplete="off"></div></div>
<div class="row" style="align-items:flex-start; gap:18px">
<div><label class="field">Notifications</label>
{% for key, label in toggles.items() %}<label class="row switch-row"><input type="checkbox" class="switch"
 name="{{ key }}" id="{{ key }}"{% if v[key] == "on" %} checked{% endif %}><span>{{ label }}</span>
<b class="state"></b></label>{% endfor %}</div>
<div><label class="field">Theme</label><div class="chips" style="flex-direction:column">
{% for key, label in themes.items() %}<label><input type="radio" name="theme" value="{{ key }}"
{% if v.theme == key %} checked{% endif %}>{{ label }}</label>{% endfor %}</div></div>
<div><label class="field" for="language">Language</label>
<select id="language" name="language" size="{{ languages|length }}">{% for lang in languages %}
<option{% if v.language == lang %} selected{% endif %}>{{ lang }}</option>{% endfor %}</select></div></div>
<div class="row"><label class="field" for="page_size" style="white-space:nowrap">Items per page</label>
<select id="page_size" name="page_size">{% for n in page_sizes %}
<option{% if v.page_size == n %} selected{% endif %}>{{ n }}</option>{% endfor %}</select>
<span class="hint">(drop-down: click it, then arrow keys and Enter)</span></div>
<div class="actions"><button>Save settings</button><a class="button secondary" href="/">Discard changes</a>
<span id="dirty" class="hint"></span></div>
</form>
<style>
.switch-row { margin: 4px 0; min-height: 40px; gap: 8px; cursor: pointer; }
.switch { appearance: none; width: 52px; height: 30px; border-radius: 15px; background: #9a9a9a;
  position: relative; margin: 0; cursor: pointer; flex: none; }
.switch::before { content: ""; position: absolute; top: 3px; left: 3px; width: 24px; height: 24px;
  border-radius: 50%; background: #fff; }
.switch:checked { background: #2e7d32; }
.switch:checked::before { left: 25px; }
.switch + span { min-width: 178px; }
.switch ~ .state::after { content: "Off"; color: #555; }
.switch:checked ~ .state::after { content: "On"; color: #1b5e20; }
</style>
<script>
// Say that the form holds changes not saved yet (the state changes only with Save).
document.getElementById("settings").addEventListener("input", () => {
  document.getElementById("dirty").textContent = "Unsaved changes";
});
</script>
{% endblock %}""",
}
ENV = templates(PAGES)


def current(db: sqlite3.Connection) -> dict[str, str]:
    return {r["key"]: r["value"] for r in db.execute("SELECT key, value FROM settings")}


def _form_page(values: dict[str, str], errors: list[str], saved: bool) -> Response:
    context: dict[str, Any] = {
        "v": values,
        "errors": errors,
        "saved": saved,
        "toggles": TOGGLES,
        "themes": THEMES,
        "languages": LANGUAGES,
        "page_sizes": PAGE_SIZES,
    }
    status = 400 if errors else 200
    return render(
        ENV, "form", status=status, title="Settings", brand="My Account", nav=[("/", "Settings")], **context
    )


async def show(request: Request) -> Response:
    with connect(db_path(request)) as db:
        values = current(db)
    return _form_page(values, [], request.query_params.get("saved") == "1")


def validate(values: dict[str, str]) -> list[str]:
    errors = []
    if not 1 <= len(values["display_name"]) <= 40:
        errors.append("The display name must be 1 to 40 characters long.")
    email = values["email"]
    if email.count("@") != 1 or "." not in email.split("@")[1] or " " in email:
        errors.append("Please enter a valid email address.")
    if values["theme"] not in THEMES:
        errors.append("Please choose a theme.")
    if values["language"] not in LANGUAGES:
        errors.append("Please choose a language.")
    if values["page_size"] not in PAGE_SIZES:
        errors.append("Please choose how many items to show per page.")
    return errors


async def save(request: Request) -> Response:
    data = await form(request)
    values = {"display_name": data.get("display_name", "").strip(), "email": data.get("email", "").strip()}
    # An unchecked checkbox is not sent at all: absent means off.
    values |= {key: "on" if key in data else "off" for key in TOGGLES}
    values |= {key: data.get(key, "") for key in ("theme", "language", "page_size")}
    errors = validate(values)
    if errors:
        return _form_page(values, errors, False)
    with connect(db_path(request)) as db:
        before = current(db)
        db.executemany("UPDATE settings SET value = ? WHERE key = ?", [(v, k) for k, v in values.items()])
        changed = ",".join(k for k in KEYS if before.get(k) != values[k])
        db.execute("INSERT INTO saves (changed) VALUES (?)", (changed,))
    return redirect("/?saved=1")


def routes() -> list[BaseRoute]:
    return [Route("/", show), Route("/", save, methods=["POST"])]
