"""web-basic: 64 tasks on the four local sites for the GUI harness (`harness: gui`).

Four task families per site, four tasks per family, each task on its own seeded copy of the site
(the products, prices, bookings, wiki facts and settings differ from task to task). The last task
of every family is held out (48 train, 16 heldout: 3 to 1, every family in both splits).

- shop: buy one product; buy two; buy a quantity; a product's price (answer);
- booking: book a table; book for a big party; book with a fallback time; a booking's time (answer);
- wiki: a year (answer); a measure (answer); edit a fact; add a sentence;
- settings: flip a switch; change the language; theme and display name; the saved email (answer).

Every task states exactly what counts, and its verifier (`openforgerl.web.verify:check`) checks
the site's state after the rollout, or the harness's answer against the seeded fact. The step limit
is 15 (OSWorld's smallest; `gui_harness(max_steps=50)` or `--max-steps` raise it).
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openforgerl.tasks.schema import PythonVerifier, Split, Task
from openforgerl.web import SEED_FILE

SUITE = "web-basic"
VERIFIER = "openforgerl.web.verify:check"
MAX_STEPS = 15
PER_FAMILY = 4
_CUSTOMERS = ("Ada Moreau", "Ben Okafor", "Clara Voss", "Dev Patel", "Elif Demir", "Finn Larsen", "Grace Liu")
_NEW_GUESTS = ("Ana Silva", "Tom Becker", "Lina Park", "Oskar Nyberg", "Eva Costa", "Raj Mehta", "Zoe Adler")
_SENTENCES = (
    "This page was last checked in 2025.",
    "More photographs are needed for this page.",
    "See also the list of local walks.",
    "Some facts on this page need a source.",
    "This page is part of the regional project.",
)
_DISPLAY_NAMES = ("Sky Walker", "River Stone", "Jo March", "Max Power", "Pat Lee", "Dana Fox")


@dataclass(frozen=True, slots=True)
class Drawn:
    instruction: str
    check: dict[str, Any]  # the verifier's kwargs
    solution: dict[str, Any]  # what a solver needs beyond the check (tests' HTTP oracle)


Family = Callable[[random.Random, int], Drawn]


# -- shop -----------------------------------------------------------------------------------------
def _shop_buy(count: int, quantity: tuple[int, int], shipping: str) -> Family:
    def draw(rng: random.Random, seed: int) -> Drawn:
        from openforgerl.web.shop import catalog

        products = rng.sample(catalog(seed), count)
        qty = rng.randint(*quantity)
        items = {p.name: qty for p in products}
        name = rng.choice(_CUSTOMERS)
        label = "express" if shipping == "express" else "standard"
        if count == 1 and qty == 1:
            what = f"one {products[0].name}"
        elif count == 1:
            what = f"{qty} of the {products[0].name} (quantity {qty})"
        else:
            what = " and ".join(f"one {p.name}" for p in products)
        instruction = f"In the shop, buy {what}. Check out with {label} shipping under the name {name}."
        check = {"kind": "order", "items": items, "shipping": shipping, "name": name}
        return Drawn(instruction, check, {})

    return draw


def _shop_price(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.shop import catalog

    product = rng.choice(catalog(seed))
    instruction = (
        f"What does the {product.name} cost in the shop? Answer with the price only, for example $4.50."
    )
    return Drawn(instruction, {"kind": "answer", "expected": product.price, "match": "money"}, {})


# -- booking --------------------------------------------------------------------------------------
def _free(w: Any, date: str) -> list[str]:
    from openforgerl.web.booking import CAPACITY, SLOTS

    return [t for t in SLOTS if w.taken(date, t) < CAPACITY]


def _booking(party: tuple[int, int]) -> Family:
    def draw(rng: random.Random, seed: int) -> Drawn:
        from openforgerl.web.booking import world

        w = world(seed)
        date = rng.choice(w.open_dates)
        time = rng.choice(_free(w, date))
        size, name = rng.randint(*party), rng.choice(_NEW_GUESTS)
        guests = "1 person" if size == 1 else f"{size} people"
        instruction = f"Book a table for {guests} on {date} at {time} under the name {name}."
        check = {"kind": "booking", "name": name, "date": date, "time": time, "party": size}
        return Drawn(instruction, check, {})

    return draw


def _booking_fallback(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.booking import CAPACITY, SLOTS, world

    w = world(seed)
    full = sorted({(b.date, b.time) for b in w.bookings if w.taken(b.date, b.time) >= CAPACITY})
    date, time = rng.choice(full)
    later = [t for t in _free(w, date) if t > time]
    assert later, "world() books out only times with free times after them"
    size, name = rng.randint(2, 6), rng.choice(_NEW_GUESTS)
    instruction = (
        f"Book a table for {size} people on {date} under the name {name}, at {time} or, if {time} is "
        "fully booked, at the next later time that day."
    )
    check = {"kind": "booking", "name": name, "date": date, "time": later[0], "party": size}
    assert SLOTS.index(later[0]) > SLOTS.index(time)
    return Drawn(instruction, check, {"asked_time": time})


def _booking_lookup(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.booking import world

    booking = rng.choice(world(seed).bookings)
    instruction = (
        f"In the list of bookings, find the booking under the name {booking.name}. At what time is it? "
        "Answer with the time only, for example 19:30."
    )
    return Drawn(instruction, {"kind": "answer", "expected": booking.time, "match": "time"}, {})


# -- wiki -----------------------------------------------------------------------------------------
def _wiki_fact(questions: dict[str, tuple[str, str]], answer: str, unit: str = "") -> Family:
    """Ask for one fact of a page: `questions` maps a page kind to (the question, the fact's name)."""

    def draw(rng: random.Random, seed: int) -> Drawn:
        from openforgerl.web.wiki import pages

        page = rng.choice([p for p in pages(seed) if p.kind in questions])
        question, fact = questions[page.kind]
        expected = page.fact(fact).removesuffix(unit)
        instruction = f"Use the wiki's search: {question.format(page.title)}? Answer with the {answer} only."
        return Drawn(instruction, {"kind": "answer", "expected": expected, "match": "number"}, {})

    return draw


_wiki_year = _wiki_fact(
    {"town": ("in which year was {} founded", "Founded"), "person": ("in which year was {} born", "Born")},
    "year",
)
_wiki_measure = _wiki_fact(
    {"mountain": ("how high is {}, in metres", "Height"), "lake": ("how deep is {}, in metres", "Depth")},
    "number",
    unit=" m",
)


def _wiki_edit_fact(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.wiki import pages

    page = rng.choice(pages(seed))
    key, value = {
        "town": lambda: ("Population", str(rng.randint(8, 400) * 100 + 50)),
        "mountain": lambda: ("Height", f"{rng.randint(1200, 4800)} m"),
        "lake": lambda: ("Depth", f"{rng.randint(8, 320)} m"),
        "person": lambda: ("Born", str(rng.randint(1700, 1930))),
    }[page.kind]()
    while value == page.fact(key):  # a change that changes nothing would be no task
        value = f"{int(value[:-2]) + 1} m" if value.endswith(" m") else str(int(value) + 1)
    instruction = (
        f'On the wiki page "{page.title}", change the {key} line to "{key}: {value}" and save the page. '
        "Leave the rest of the page as it is."
    )
    check = {"kind": "wiki_edit", "slug": page.slug, "facts": {key: value}}
    return Drawn(instruction, check, {"old": f"{key}: {page.fact(key)}"})


def _wiki_append(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.wiki import pages

    page = rng.choice(pages(seed))
    sentence = rng.choice(_SENTENCES)
    instruction = (
        f'At the end of the wiki page "{page.title}", add the sentence "{sentence}" and save the page.'
    )
    return Drawn(instruction, {"kind": "wiki_edit", "slug": page.slug, "append": sentence}, {})


# -- settings -------------------------------------------------------------------------------------
def _settings_toggle(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.settings import TOGGLES, defaults

    key = rng.choice(list(TOGGLES))
    target = "off" if defaults(seed)[key] == "on" else "on"
    instruction = f"In the account settings, turn {target} {TOGGLES[key]}, then save the settings."
    return Drawn(instruction, {"kind": "settings", "values": {key: target}}, {})


def _settings_language(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.settings import LANGUAGES, defaults

    language = rng.choice([lang for lang in LANGUAGES if lang != defaults(seed)["language"]])
    instruction = f"In the account settings, change the language to {language}, then save the settings."
    return Drawn(instruction, {"kind": "settings", "values": {"language": language}}, {})


def _settings_profile(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.settings import THEMES, defaults

    theme = rng.choice([t for t in THEMES if t != defaults(seed)["theme"]])
    name = rng.choice(_DISPLAY_NAMES)
    instruction = (
        f"In the account settings, choose the {THEMES[theme]} theme and change the display name to {name}, "
        "then save the settings."
    )
    return Drawn(instruction, {"kind": "settings", "values": {"theme": theme, "display_name": name}}, {})


def _settings_email(rng: random.Random, seed: int) -> Drawn:
    from openforgerl.web.settings import defaults

    instruction = "What email address is saved in the account settings? Answer with the address only."
    return Drawn(instruction, {"kind": "answer", "expected": defaults(seed)["email"], "match": "text"}, {})


FAMILIES: dict[str, dict[str, Family]] = {
    "shop": {
        "buy-one": _shop_buy(1, (1, 1), "standard"),
        "buy-two": _shop_buy(2, (1, 1), "express"),
        "buy-quantity": _shop_buy(1, (2, 3), "standard"),
        "price": _shop_price,
    },
    "booking": {
        "book": _booking((1, 4)),
        "book-large": _booking((5, 8)),
        "book-fallback": _booking_fallback,
        "lookup": _booking_lookup,
    },
    "wiki": {
        "year": _wiki_year,
        "measure": _wiki_measure,
        "edit-fact": _wiki_edit_fact,
        "append": _wiki_append,
    },
    "settings": {
        "switch": _settings_toggle,
        "language": _settings_language,
        "profile": _settings_profile,
        "email": _settings_email,
    },
}


def site_seed(seed: int, site: str, family: str, k: int, attempt: int = 0) -> int:
    """Each task's own copy of its site (a stable hash: the same on every machine and Python)."""
    return zlib.crc32(f"{seed}/{site}/{family}/{k}/{attempt}".encode()) % 1_000_000


def generate(seed: int = 0, per_family: int = PER_FAMILY) -> list[Task]:
    """Every family's `per_family` tasks; the last of each family is held out. No two tasks ask the
    same thing with the same answer (a repeat is drawn again from the next seed)."""
    tasks = []
    seen: set[str] = set()
    for site, families in FAMILIES.items():
        for family, draw in families.items():
            for k in range(per_family):
                for attempt in itertools.count():
                    data_seed = site_seed(seed, site, family, k, attempt)
                    drawn = draw(random.Random(f"task/{data_seed}"), data_seed)
                    key = json.dumps([drawn.instruction, drawn.check], sort_keys=True)
                    if key not in seen:
                        seen.add(key)
                        break
                split: Split = "heldout" if k == per_family - 1 else "train"
                tasks.append(
                    Task(
                        id=f"web-{site}-{family}-{k}",
                        instruction=drawn.instruction,
                        split=split,
                        files={SEED_FILE: json.dumps({"site": site, "seed": data_seed}) + "\n"},
                        harness="gui",
                        harness_options={"site": site, "max_steps": MAX_STEPS},
                        verifier=PythonVerifier(python=VERIFIER, kwargs=drawn.check),
                        tags=[SUITE, site, family],
                        metadata={"site": site, "family": family, "seed": data_seed, **drawn.solution},
                    )
                )
    return tasks
