"""The viewer's JSON API: one method an endpoint (`Api`), the query's parameters checked, and the
images a rollout's calls name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from openforgerl.store import CallRow, public_calls
from openforgerl.store.view import DIGEST, MAX_PAGE_SIZE, SORTS, Filters, StoreView, failure_reason
from openforgerl.ui.compare import compare_reports, read_report
from openforgerl.ui.guard import json_response
from openforgerl.ui.runs import metrics_after, runner_record, trainer_tokens
from openforgerl.ui.tokens import token_view
from openforgerl.ui.viewer import ApiError, Viewer, ViewerConfig

STATIC = Path(__file__).parent / "static"
# An image's URL names its bytes (their sha256): a browser may keep it for good and never ask again.
IMAGE_CACHE = "private, max-age=31536000, immutable"


class Api:
    """The endpoints under /api (and the page at /), each a method taking the request."""

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self.cfg: ViewerConfig = viewer.cfg

    def info(self, request: Request) -> Response:
        self.viewer.runs()  # opens the stores, so that their missing indexes are known
        return json_response(
            {
                "read_only": not self.cfg.create_indexes,
                "store": str(self.cfg.store) if self.cfg.store else None,
                "runs_dir": str(self.cfg.runs) if self.cfg.runs else None,
                "model": str(self.cfg.model) if self.cfg.model else None,
                "missing_indexes": self.viewer.missing_indexes(),
                "poll_seconds": self.cfg.poll_seconds,
            }
        )

    def runs(self, request: Request) -> Response:
        found = self.viewer.runs(fresh=True)
        out = []
        for r in found.values():
            if r.parent is None and r.step_of is None:  # phases and steps are listed under their run
                out.append(self.viewer.run_overview(r, detail=False) | {"phases": self.viewer.phases(r)})
        return json_response({"runs": out})

    def compare(self, request: Request) -> Response:
        names = [n for n in request.query_params.getlist("runs") if n]
        if len(names) < 2:
            raise ApiError(400, "name two or more evaluation runs: ?runs=A&runs=B", "runs")
        reports, parents = [], set()
        for name in names:
            found = self.viewer.runs().get(name) or self.viewer.runs(fresh=True).get(name)
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
            return json_response(
                compare_reports(reports) | {"parent": parents.pop() if len(parents) == 1 else None}
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), "runs") from None

    def run(self, request: Request) -> Response:
        return json_response(self.viewer.run_overview(self.viewer.run(request), detail=True))

    def metrics(self, request: Request) -> Response:
        found = self.viewer.run(request)
        after = _float(request, "after")
        rows = metrics_after(self.viewer.metrics(found.folder).read(), after) if found.folder else []
        return json_response({"run": found.name, "rows": rows})

    def rollouts(self, request: Request) -> Response:
        found = self.viewer.run(request)
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
            return json_response(
                {"run": found.name, "total": 0, "page": page, "page_size": page_size, "rows": []}
            )
        view = self.viewer.store_view(found.store)
        total, rows = view.page(
            found.run_id, sort=sort, desc=desc, filters=filters, page=page, page_size=page_size
        )
        return json_response(
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

    def rollout(self, request: Request) -> Response:
        found, (row, calls, stats) = self.viewer.rollout(request)
        view = token_view(calls, float(row.reward or 0.0), None, {})
        samples = [
            {k: v for k, v in s.items() if k not in ("input_ids", "loss_mask", "logprobs", "policy_versions")}
            | {"tokens": len(s["input_ids"]), "trained": sum(s["loss_mask"])}
            for s in view["samples"]
        ]
        images = _image_refs(self.viewer.store_view(found.store) if found.store else None, found.name, calls)
        return json_response(
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

    def tokens(self, request: Request) -> Response:
        found, (row, calls, _) = self.viewer.rollout(request)
        trainer = trainer_tokens(found.folder, row.id)
        return json_response(
            token_view(calls, float(row.reward or 0.0), self.viewer.model_for(found), trainer)
        )

    def image(self, request: Request) -> Response:
        found = self.viewer.run(request)
        digest = request.path_params["digest"].lower()
        if not DIGEST.fullmatch(digest):
            named = "an image is named by the sha256 of its bytes (64 hex digits)"
            raise ApiError(400, f"{named}, got {digest[:80]!r}", "digest")
        headers = {"cache-control": IMAGE_CACHE, "etag": f'"{digest}"'}
        if _etag_matches(request.headers.get("if-none-match", ""), digest):
            return Response(status_code=304, headers=headers)  # the same name is the same bytes
        got = self.viewer.store_view(found.store).image(digest) if found.store else None
        if got is None:
            raise ApiError(404, f"no image {digest} in the store of run {found.name!r}", "digest")
        media_type, data = got
        extension = media_type.rsplit("/", 1)[-1] if media_type.startswith("image/") else "bin"
        headers["content-disposition"] = f'inline; filename="{digest[:16]}.{extension}"'
        return Response(data, media_type=media_type, headers=headers)

    def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    def api_404(self, request: Request) -> Response:
        raise ApiError(404, f"no API endpoint {request.url.path}")

    async def on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return json_response(
            {"error": {"status": exc.status, "message": exc.message, "param": exc.param}}, exc.status
        )

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return json_response({"error": {"status": exc.status_code, "message": exc.detail}}, exc.status_code)


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
