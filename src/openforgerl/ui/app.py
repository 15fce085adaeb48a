"""The viewer's Starlette app: a read-only JSON API under /api and the static front end."""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from openforgerl.jsonutil import dumps
from openforgerl.run_status import read_status
from openforgerl.store import CallRow, public_calls
from openforgerl.store.view import DIGEST, MAX_PAGE_SIZE, SORTS, Filters, StoreView, failure_reason
from openforgerl.ui.compare import comparable_groups, compare_reports, eval_key, read_report
from openforgerl.ui.runs import (
    MetricsFile,
    Run,
    eval_reports,
    metrics_after,
    model_dir_of,
    phases_of,
    read_config,
    read_json,
    report_headline,
    run_folders,
    run_status,
    runner_progress,
    runner_record,
    step_order,
    trainer_tokens,
)
from openforgerl.ui.tokens import token_view

STATIC = Path(__file__).parent / "static"
COOKIE = "openforge_view_token"
DISCOVERY_TTL = 2.0  # seconds a run listing is reused: polls from several tabs share one scan
NO_RUN_ID = "(no run id)"  # the run of rollouts opened without a run_id
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
# An image's URL names its bytes (their sha256): a browser may keep it for good and never ask again.
IMAGE_CACHE = "private, max-age=31536000, immutable"
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ViewerConfig:
    store: Path | None = None  # a gateway store (its rollouts' run_ids become runs)
    runs: Path | None = None  # a folder of run folders (or one run folder)
    model: Path | None = None  # the tokenizer for every run (else each run's config names one)
    token: str = ""  # required on every request when set
    create_indexes: bool = False  # the only write: VIEWER_INDEXES on the stores, IF NOT EXISTS
    poll_seconds: float = 3.0  # how often the front end polls an active run


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _json(data: Any, status: int = 200) -> Response:
    return Response(dumps(data), status_code=status, media_type="application/json")


class Viewer:
    """Finds runs, holds one StoreView per store file, answers the API."""

    def __init__(self, cfg: ViewerConfig) -> None:
        if cfg.store is None and cfg.runs is None:
            raise ValueError("give a store, a runs folder, or both")
        if cfg.runs is not None and not cfg.runs.is_dir():
            raise FileNotFoundError(f"no runs folder at {cfg.runs}")
        self.cfg = cfg
        self._lock = threading.Lock()
        self._stores: dict[Path, StoreView] = {}
        self._metrics: dict[Path, MetricsFile] = {}
        self._runs: dict[str, Run] = {}
        self._runs_at = 0.0
        if cfg.store is not None:
            self.store_view(cfg.store)  # a wrong --store fails at start, not on the first page

    def close(self) -> None:
        for view in self._stores.values():
            view.close()

    def store_view(self, path: Path) -> StoreView:
        key = path.resolve()
        with self._lock:
            if key not in self._stores:
                self._stores[key] = StoreView(key, create_indexes=self.cfg.create_indexes)
            return self._stores[key]

    def metrics(self, folder: Path) -> MetricsFile:
        key = (folder / "metrics.jsonl").resolve()
        with self._lock:
            return self._metrics.setdefault(key, MetricsFile(key))

    def missing_indexes(self) -> dict[str, list[str]]:
        with self._lock:
            return {str(p): v.missing_indexes for p, v in self._stores.items() if v.missing_indexes}

    # -- runs -------------------------------------------------------------------------------
    def runs(self, fresh: bool = False) -> dict[str, Run]:
        if fresh or time.monotonic() - self._runs_at > DISCOVERY_TTL:
            self._runs, self._runs_at = self._discover(), time.monotonic()
        return self._runs

    def _discover(self) -> dict[str, Run]:
        runs: dict[str, Run] = {}
        main = self.cfg.store.resolve() if self.cfg.store else None
        claimed: set[str] = set()  # run_ids of the main store that a folder stands for
        for name, folder, parent in run_folders(self.cfg.runs) if self.cfg.runs else []:
            own = folder / "gateway.db"
            if own.is_file() and own.resolve() != main:
                ids = self.store_view(own).run_ids()
                if folder.name in ids or len(ids) <= 1:
                    # An eval's run_id is its folder's name; a store with one run_id is that run's.
                    primary = folder.name if folder.name in ids or not ids else ids[0]
                    runs[name] = Run(name, primary, folder, own, parent)
                    others = [rid for rid in ids if rid != primary]
                else:
                    # A trainer's store: one run_id per step (rl-step1, rl-step2, ...), steps of one
                    # run; the run's own rollouts are its last step's.
                    others = sorted(ids, key=step_order)
                    runs[name] = Run(name, others[-1], folder, own, parent, steps=others)
                for rid in others:
                    runs[f"{name}#{rid}"] = Run(f"{name}#{rid}", rid, folder, own, parent, step_of=name)
            else:
                runs[name] = Run(name, folder.name, folder, main, parent)
                claimed.add(folder.name)
        if main is not None:
            for rid in self.store_view(main).run_ids():
                name = rid or NO_RUN_ID
                if rid not in claimed and name not in runs:
                    runs[name] = Run(name, rid, None, main)
        return runs

    def run(self, request: Request) -> Run:
        name = request.query_params.get("run")
        if name is None:
            raise ApiError(400, "the 'run' parameter is required", "run")
        run = self.runs().get(name) or self.runs(fresh=True).get(name)
        if run is None:
            raise ApiError(404, f"no run named {name!r}", "run")
        return run

    def model_for(self, run: Run) -> Path | None:
        if self.cfg.model is not None:
            return self.cfg.model
        return model_dir_of(read_config(run.folder)) if run.folder else None

    def phase_record(self, run: Run) -> dict[str, Any] | None:
        """The run's entry in its parent's status.json phases (the demo records each phase)."""
        parent = self.runs().get(run.parent) if run.parent else None
        if parent is None or parent.folder is None or run.folder is None:
            return None
        for phase in phases_of(read_status(parent.folder)).values():
            folder = phase.get("folder")
            if isinstance(folder, str) and (parent.folder / folder).resolve() == run.folder.resolve():
                return phase
        # A demo from before status.json: timings.json has the seconds of each phase that finished.
        timings = read_json(parent.folder / "timings.json")
        key = run.name.removeprefix(f"{parent.name}/").replace("/", "-")
        if isinstance(timings, dict) and key in timings:
            return {"state": "finished", "seconds": timings[key], "source": "the run's timings.json"}
        return None

    def run_overview(self, run: Run, *, detail: bool) -> dict[str, Any]:
        totals = self.store_view(run.store).run_totals(run.run_id) if run.store else None
        progress = runner_progress(run.folder) if run.folder and not run.step_of else {}
        rows = self.metrics(run.folder).read() if run.folder and not run.step_of else []
        last = rows[-1] if rows else None
        open_rollouts = totals["by_status"].get("open", 0) if totals else 0
        if run.step_of:
            status = {"state": "finished" if not open_rollouts else "running", "source": "store"}
        else:
            status = run_status(run.folder, progress, open_rollouts, self.phase_record(run))
        out: dict[str, Any] = {
            "name": run.name,
            "run_id": run.run_id,
            "folder": str(run.folder) if run.folder else None,
            "store": str(run.store) if run.store else None,
            "parent": run.parent,
            "step_of": run.step_of,
            "status": status,
            "progress": progress,
            "totals": totals,
            # Training steps: a step 0 line holds the starting policy's measurements (headroom, eval).
            "steps": len({r["step"] for r in rows if r["step"] > 0}) or len(run.steps),
            "last_metrics": last,
            "report": report_headline(run.folder) if run.folder and not run.step_of else None,
        }
        if detail:
            model = self.model_for(run)
            out["config"] = read_config(run.folder) if run.folder else {}
            out["model"] = str(model) if model else None
            out["evals"] = eval_reports(run.folder) if run.folder and not run.step_of else []
            out["poll_seconds"] = self.cfg.poll_seconds
            out["phases"] = self.phases(run)
            out["step_runs"] = [
                {
                    "name": f"{run.name}#{rid}",
                    "run_id": rid,
                    "totals": self.store_view(run.store).run_totals(rid),
                }
                for rid in run.steps
                if run.store
            ]
            out["comparisons"] = comparable_groups(
                [(p["run"], p["eval"]) for p in out["phases"] if p.get("run") and p.get("eval")]
            )
        return out

    def phases(self, top: Run) -> list[dict[str, Any]]:
        """The run's phases: those its status.json records, in its order (each with the run folder
        it wrote, when that is a run), then the run folders below it that the record does not name."""
        runs = self.runs()
        below = [r for r in runs.values() if not r.step_of and r.folder and r.name.startswith(f"{top.name}/")]
        by_folder = {r.folder.resolve(): r for r in below if r.folder}
        out: list[dict[str, Any]] = []
        named: set[str] = set()
        recorded = phases_of(read_status(top.folder)) if top.folder else {}
        for label, phase in recorded.items():
            folder = phase.get("folder")
            run = (
                by_folder.get((top.folder / folder).resolve())
                if top.folder and isinstance(folder, str)
                else None
            )
            out.append(self._phase_row(label, phase, run))
            if run is not None:
                named.add(run.name)
        # A demo from before status.json: its timings.json names the phases in the order they ran.
        timings = read_json(top.folder / "timings.json") if top.folder else None
        order = list(timings) if isinstance(timings, dict) else []

        def ran(run: Run) -> int:
            key = run.name.removeprefix(f"{top.name}/").replace("/", "-")
            return order.index(key) if key in order else len(order)

        for run in sorted(below, key=ran):
            if run.name not in named:
                out.append(self._phase_row(run.name.removeprefix(f"{top.name}/"), None, run))
        return out

    def _phase_row(self, label: str, phase: dict[str, Any] | None, run: Run | None) -> dict[str, Any]:
        row: dict[str, Any] = {"phase": label, "run": run.name if run else None}
        if run is not None:
            overview = self.run_overview(run, detail=False)
            row |= {
                k: overview[k] for k in ("status", "steps", "last_metrics", "report", "totals", "progress")
            }
            row["eval"] = eval_key(run.folder) if run.folder else None
        else:
            at = (phase or {}).get("finished_at") or (phase or {}).get("started_at")
            row["status"] = {**(phase or {}), "source": "the run's status.json", "changed_at": at}
            row["folder"] = (phase or {}).get("folder")
        return row

    def rollout(self, request: Request) -> tuple[Run, Any]:
        run = self.run(request)
        rollout_id = request.query_params.get("id")
        if not rollout_id:
            raise ApiError(400, "the 'id' parameter (a rollout id) is required", "id")
        found = self.store_view(run.store).rollout(rollout_id) if run.store else None
        if found is None or found[0].run_id != run.run_id:
            raise ApiError(404, f"no rollout {rollout_id!r} in run {run.name!r}", "id")
        return run, found


# -- parameters ---------------------------------------------------------------------------------
# Far past any run's last page, and small enough that the page's offset fits SQLite's 64-bit OFFSET
# (beyond it the query raised: a plain-text 500).
MAX_PAGE = 1 << 40


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if raw.isascii() else low - 1  # int() takes other scripts' digits too
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be an integer from {low} to {high}, got {raw[:80]!r}", name)
    return value


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw) if raw.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan or inf would quietly match nothing (or everything)
        raise ApiError(400, f"'{name}' must be a finite number, got {raw[:80]!r}", name)
    return value


def _sort(request: Request) -> tuple[str, bool]:
    raw = request.query_params.get("sort") or "created"
    key = raw.removeprefix("-")
    if key not in SORTS:
        keys = ", ".join(SORTS)
        raise ApiError(400, f"unknown sort key {raw!r}: one of {keys}, '-' in front for descending", "sort")
    return key, raw.startswith("-")


def _opt(request: Request, name: str) -> str | None:
    return request.query_params.get(name) or None


# -- endpoints ------------------------------------------------------------------------------------
def build_app(cfg: ViewerConfig) -> Starlette:
    viewer = Viewer(cfg)

    def info(request: Request) -> Response:
        viewer.runs()  # opens the stores, so that their missing indexes are known
        return _json(
            {
                "read_only": not cfg.create_indexes,
                "store": str(cfg.store) if cfg.store else None,
                "runs_dir": str(cfg.runs) if cfg.runs else None,
                "model": str(cfg.model) if cfg.model else None,
                "missing_indexes": viewer.missing_indexes(),
                "poll_seconds": cfg.poll_seconds,
            }
        )

    def runs(request: Request) -> Response:
        found = viewer.runs(fresh=True)
        out = []
        for r in found.values():
            if r.parent is None and r.step_of is None:  # phases and steps are listed under their run
                out.append(viewer.run_overview(r, detail=False) | {"phases": viewer.phases(r)})
        return _json({"runs": out})

    def compare(request: Request) -> Response:
        names = [n for n in request.query_params.getlist("runs") if n]
        if len(names) < 2:
            raise ApiError(400, "name two or more evaluation runs: ?runs=A&runs=B", "runs")
        reports, parents = [], set()
        for name in names:
            found = viewer.runs().get(name) or viewer.runs(fresh=True).get(name)
            if found is None:
                raise ApiError(404, f"no run named {name!r}", "runs")
            report = read_report(found.folder) if found.folder else None
            if not report or not report.get("summary"):
                raise ApiError(
                    400, f"run {name!r} has no evaluation report (report.json) with scores", "runs"
                )
            reports.append((name, report))
            parents.add(found.parent)
        try:
            # The run they are phases of, when they share one (the demo's), for the breadcrumbs.
            return _json(compare_reports(reports) | {"parent": parents.pop() if len(parents) == 1 else None})
        except ValueError as exc:
            raise ApiError(400, str(exc), "runs") from None

    def run(request: Request) -> Response:
        return _json(viewer.run_overview(viewer.run(request), detail=True))

    def metrics(request: Request) -> Response:
        found = viewer.run(request)
        after = _float(request, "after")
        rows = metrics_after(viewer.metrics(found.folder).read(), after) if found.folder else []
        return _json({"run": found.name, "rows": rows})

    def rollouts(request: Request) -> Response:
        found = viewer.run(request)
        page = _int(request, "page", 1, 1, MAX_PAGE)
        page_size = _int(request, "page_size", 50, 1, MAX_PAGE_SIZE)
        sort, desc = _sort(request)
        filters = Filters(
            status=_opt(request, "status"),
            task=_opt(request, "task"),
            dialect=_opt(request, "dialect"),
            failure=_opt(request, "failure"),
            min_reward=_float(request, "min_reward"),
            max_reward=_float(request, "max_reward"),
        )
        if found.store is None:
            return _json({"run": found.name, "total": 0, "page": page, "page_size": page_size, "rows": []})
        view = viewer.store_view(found.store)
        total, rows = view.page(
            found.run_id, sort=sort, desc=desc, filters=filters, page=page, page_size=page_size
        )
        return _json(
            {
                "run": found.name,
                "total": total,
                "page": page,
                "page_size": page_size,
                "sort": ("-" if desc else "") + sort,
                "rows": rows,
                "facets": view.facets(found.run_id),
            }
        )

    def rollout(request: Request) -> Response:
        found, (row, calls, stats) = viewer.rollout(request)
        view = token_view(calls, float(row.reward or 0.0), None, {})
        samples = [
            {k: v for k, v in s.items() if k not in ("input_ids", "loss_mask", "logprobs", "policy_versions")}
            | {"tokens": len(s["input_ids"]), "trained": sum(s["loss_mask"])}
            for s in view["samples"]
        ]
        images = _image_refs(viewer.store_view(found.store) if found.store else None, found.name, calls)
        return _json(
            {
                "run": found.name,
                "rollout": row.public(),
                "stats": stats,
                "failure": failure_reason(row.status, row.details, stats.get("failed_calls", 0)),
                "runner": runner_record(found.folder, row.id),
                "calls": [_with_image_refs(c, images) for c in public_calls(calls, tokens=False)],
                "samples": samples,
            }
        )

    def tokens(request: Request) -> Response:
        found, (row, calls, _) = viewer.rollout(request)
        trainer = trainer_tokens(found.folder, row.id)
        return _json(token_view(calls, float(row.reward or 0.0), viewer.model_for(found), trainer))

    def image(request: Request) -> Response:
        found = viewer.run(request)
        digest = request.path_params["digest"].lower()
        if not DIGEST.fullmatch(digest):
            named = "an image is named by the sha256 of its bytes (64 hex digits)"
            raise ApiError(400, f"{named}, got {digest[:80]!r}", "digest")
        headers = {"cache-control": IMAGE_CACHE, "etag": f'"{digest}"'}
        if _etag_matches(request.headers.get("if-none-match", ""), digest):
            return Response(status_code=304, headers=headers)  # the same name is the same bytes
        got = viewer.store_view(found.store).image(digest) if found.store else None
        if got is None:
            raise ApiError(404, f"no image {digest} in the store of run {found.name!r}", "digest")
        media_type, data = got
        extension = media_type.rsplit("/", 1)[-1] if media_type.startswith("image/") else "bin"
        headers["content-disposition"] = f'inline; filename="{digest[:16]}.{extension}"'
        return Response(data, media_type=media_type, headers=headers)

    def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    def api_404(request: Request) -> Response:
        raise ApiError(404, f"no API endpoint {request.url.path}")

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _json(
            {"error": {"status": exc.status, "message": exc.message, "param": exc.param}}, exc.status
        )

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _json({"error": {"status": exc.status_code, "message": exc.detail}}, exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        viewer.close()

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/info", info),
            Route("/api/runs", runs),
            Route("/api/run", run),
            Route("/api/compare", compare),
            Route("/api/metrics", metrics),
            Route("/api/rollouts", rollouts),
            Route("/api/rollout", rollout),
            Route("/api/tokens", tokens),
            Route("/api/images/{digest}", image),
            Route("/api/{rest:path}", api_404),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=[Middleware(_Guard, token=cfg.token)],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error},
        lifespan=lifespan,
    )
    app.state.viewer = viewer
    return app


def _etag_matches(header: str, digest: str) -> bool:
    tags = {t.strip().removeprefix("W/").strip('"') for t in header.split(",")}
    return digest in tags or "*" in tags


def _image_refs(view: StoreView | None, run: str, calls: list[CallRow]) -> dict[str, dict[str, Any]]:
    """What the front end needs to show each image the calls' messages name, by digest: its URL,
    size in pixels (so a thumbnail takes its place before it loads) and whether the store has it."""
    named = [d for c in calls for m in c.messages_delta for d in _digests(m)]
    named += [d for c in calls for d in _digests(c.response)]
    info = view.image_info(named) if view is not None else {}
    empty = {"media_type": None, "width": None, "height": None, "size": None}
    return {
        d: {
            "digest": d,
            "url": f"/api/images/{d}?{urlencode({'run': run})}",
            "stored": d in info,
            **info.get(d, empty),
        }
        for d in dict.fromkeys(named)
    }


def _digests(message: Any) -> list[str]:
    found = message.get("images") if isinstance(message, dict) else None
    return [d for d in found if isinstance(d, str)] if isinstance(found, list) else []


def _with_images(message: Any, images: dict[str, dict[str, Any]]) -> Any:
    """A recorded message with its image digests replaced by the images' descriptions."""
    if not _digests(message):
        return message
    return {**message, "images": [images[d] for d in _digests(message)]}


def _with_image_refs(call: dict[str, Any], images: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A call in the store's public shape, its messages' and response's image digests replaced by
    the images' descriptions."""
    return {
        **call,
        "messages_delta": [_with_images(m, images) for m in call["messages_delta"]],
        "response": _with_images(call["response"], images),
    }


class _Guard(BaseHTTPMiddleware):
    """With a token: every request carries it (bearer header, cookie, or ?token= once, which sets the
    cookie). Without one (loopback only): the Host must be a loopback name, so a web page cannot
    reach the viewer through DNS rebinding."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if not self.token:
            host = _hostname(request.headers.get("host", ""))
            if host and not is_loopback(host):
                return _json({"error": {"status": 403, "message": f"host {host!r} is not loopback"}}, 403)
            return _secure(await call_next(request))
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            # Trade the token in the address for a cookie, and drop it from the address bar.
            redirect = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
            redirect.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return redirect
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        cookie = request.cookies.get(COOKIE, "")
        if any(c and hmac.compare_digest(c.encode(), self.token.encode()) for c in (bearer, cookie)):
            return _secure(await call_next(request))
        return _json(
            {"error": {"status": 401, "message": "this viewer needs its token: open it with ?token=TOKEN"}},
            401,
        )


def _hostname(header: str) -> str:
    """The host of a Host header, without the port ('[::1]:8000' -> '[::1]')."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0]


def _secure(response: Response) -> Response:
    response.headers.setdefault("content-security-policy", CSP)
    response.headers.setdefault("x-content-type-options", "nosniff")
    response.headers.setdefault("referrer-policy", "no-referrer")
    return response


def serve(app: Starlette, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


__all__ = ["ApiError", "ViewerConfig", "build_app", "is_loopback", "serve"]
