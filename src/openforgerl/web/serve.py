"""Serve one of the sites (shop, booking, wiki, settings) on loopback.

    python -m openforgerl.web.serve SITE --port P --state .openforge/site.db [--seed N]

The state file is created and seeded on first start: from --seed, else from the seed file next to
it (`site.json`, `{"site": SITE, "seed": N}`, which a task puts into its work directory), else 0.
A state file that exists is served as it is, so a restarted server continues where it stopped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import socket
import sys
from pathlib import Path
from typing import cast

from starlette.applications import Starlette

from openforgerl.web import SITES
from openforgerl.web.common import SiteModule, create_state


def site_module(name: str) -> SiteModule:
    if name not in SITES:
        raise ValueError(f"unknown site {name!r}; the sites are {', '.join(SITES)}")
    return cast(SiteModule, importlib.import_module(f"openforgerl.web.{name}"))


def seed_from_file(state: Path, site: str) -> int:
    seed_file = state.with_name("site.json")
    if not seed_file.is_file():
        return 0
    doc = json.loads(seed_file.read_text())
    if doc.get("site", site) != site:
        raise ValueError(f"{seed_file} is for the site {doc['site']!r}, not {site!r}")
    return int(doc.get("seed", 0))


def build_app(site: str, state: str | Path, seed: int | None = None) -> Starlette:
    """The site's app over the state file, which is created and seeded first if missing."""
    module = site_module(site)
    path = Path(state)
    if not path.exists():
        create_state(module, path, seed_from_file(path, site) if seed is None else seed)
    app = Starlette(routes=module.routes())
    app.state.db_path = str(path)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("site", choices=SITES)
    ap.add_argument("--state", required=True, help="the SQLite state file (created and seeded if missing)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--host", default="127.0.0.1")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="the port to listen on")
    where.add_argument("--fd", type=int, help="an inherited listening socket (no race for a free port)")
    a = ap.parse_args(argv)
    import uvicorn

    app = build_app(a.site, a.state, a.seed)
    config = uvicorn.Config(app, host=a.host, port=a.port or 0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if a.fd is not None:
        server.run(sockets=[socket.socket(fileno=a.fd)])
    else:
        server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
