"""Small local web apps for GUI/browser agents and the web-basic suite's verifiers (`verify.py`).

The suite's tasks are drawn in `tasks/suites/web_basic.py`; the LLM judge of live web benchmarks is
`tasks/judge.py`. Nothing here imports `openforgerl.tasks`: the sites run inside a sandbox, which
sees only them (`harnesses/launch.py` SANDBOX_MODULES).

Four sites, each a Starlette app with server-rendered HTML and plain forms, sized for a 640x480
screenshot (large controls, high contrast: a small vision model has to read them):

- ``shop``: products, a cart with quantities, a checkout form (name, shipping) that places an order;
- ``booking``: a restaurant's table booking form (name, date, time, party size) with validation and
  fully booked slots, and the list of bookings;
- ``wiki``: pages about made-up places and people, search, and page editing (revisions kept);
- ``settings``: an account's settings (toggles, radio choices, a list box, text fields) saved by a
  Save button.

A site's whole state is one SQLite file in the task's work directory (``.openforge/site.db``),
seeded deterministically from ``.openforge/site.json`` (``{"site": ..., "seed": N}``) on first
start; the verifiers (`openforgerl.web.verify`) read that file after the rollout. Every fact a task
asks about is made up from the seed, so a model cannot know it without looking at the page.

    python -m openforgerl.web.serve SITE --port P --state .openforge/site.db
"""

from __future__ import annotations

SITES = ("shop", "booking", "wiki", "settings")
STATE_FILE = ".openforge/site.db"
SEED_FILE = ".openforge/site.json"
