"""The store read-only, as the viewer reads it: pages of rollouts, one rollout with its calls, run
totals, images. `Store` is the gateway's (it writes); `StoreView` never writes.

The store is opened with a `mode=ro` URI, so the viewer can never write to it. Sorting and paging
stay index-backed at 100,000+ rollouts:

- sorts on the rollouts table use the store's `rollouts_run` index and its `VIEWER_INDEXES`;
- turns, tokens and dialect live in the calls table. Calls are append-only (never updated once
  inserted) and rollouts' rowids only grow, so a TEMP table on the viewer's own connection (the
  only thing a read-only connection may write) sums them incrementally: each refresh reads only the
  calls and rollouts past the last ids it saw, and the TEMP table carries its own indexes.

Every page query is `... WHERE run_id = ? ORDER BY <key>, rowid LIMIT ? OFFSET ?` on one index,
with the join order fixed by CROSS JOIN so the planner cannot trade the index for a sort.

Images (screenshots a harness sent) are kept once each in the store's `images` table, named by the
hex sha256 of their bytes; calls name them by digest. A store from before images has neither the
table nor the calls' `image_digests` column, and the viewer cannot add them (read-only): it reads
such a store as one without images.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from openforgerl.images import MEDIA_TYPES
from openforgerl.store.records import CallRow, RolloutRow
from openforgerl.store.sqlite import (
    CALL_COLS,
    IN_CHUNK,
    ROLLOUT_COLS,
    VIEWER_INDEXES,
    call_from_row,
    connect_read_only,
    rollout_from_row,
)

_STATS_SCHEMA = """
CREATE TEMP TABLE IF NOT EXISTS rollout_stats (
    rid INTEGER PRIMARY KEY,  -- the rollout's rowid in main.rollouts
    rollout_id TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL,
    turns INTEGER NOT NULL DEFAULT 0,
    tokens INTEGER NOT NULL DEFAULT 0,
    sampled INTEGER NOT NULL DEFAULT 0,
    failed_calls INTEGER NOT NULL DEFAULT 0,
    dialect TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS temp.rollout_stats_turns ON rollout_stats(run_id, turns);
CREATE INDEX IF NOT EXISTS temp.rollout_stats_tokens ON rollout_stats(run_id, tokens);
CREATE INDEX IF NOT EXISTS temp.rollout_stats_dialect ON rollout_stats(run_id, dialect);
"""

# Per rollout: calls, tokens (prompt deltas + completions, from blob lengths at 4 bytes an id: the
# blobs are never decoded), sampled tokens, failed calls, and the lowest and highest dialect.
_CALL_SUMS = (
    "SELECT rollout_id, COUNT(*) AS n, SUM(length(prompt_delta) + length(completion_ids)) / 4 AS tok,"
    " SUM(length(completion_ids)) / 4 AS smp, SUM(status != 'ok') AS bad, MIN(dialect) AS lo,"
    " MAX(dialect) AS hi FROM main.calls"
)

# sort key -> (table the scan is driven by: r = rollouts, s = rollout_stats; the SQL it sorts on).
# The expressions match the index definitions token for token, or SQLite will not use them.
SORTS: dict[str, tuple[str, str]] = {
    "created": ("r", "r.created_at"),
    "task": ("r", "r.task_id"),
    "status": ("r", "r.status"),
    "reward": ("r", "r.reward"),
    "seconds": ("r", "r.closed_at - r.created_at"),
    "failure": ("r", "json_extract(r.details, '$.outcome')"),
    "turns": ("s", "s.turns"),
    "tokens": ("s", "s.tokens"),
    "dialect": ("s", "s.dialect"),
}
MAX_PAGE_SIZE = 500

DIGEST = re.compile(r"[0-9a-f]{64}")  # an image's name: the hex sha256 of its bytes
# What the gateway stores (it reads the type off the bytes); anything else is served as opaque bytes.
IMAGE_TYPES = frozenset(MEDIA_TYPES.values())
# The calls' columns for a store from before images, which lacks `image_digests`.
_OLD_CALL_COLS = CALL_COLS.replace("image_digests", "'[]' AS image_digests")


@dataclass(frozen=True)
class Filters:
    status: str | None = None  # exact
    task: str | None = None  # substring of the task id
    dialect: str | None = None  # exact ('mixed' when a rollout used several)
    failure: str | None = None  # exact outcome recorded at close (timeout, crash, ...)
    min_reward: float | None = None
    max_reward: float | None = None

    def clauses(self) -> list[tuple[str, str, Any]]:
        """(table, SQL condition, parameter) for each filter that is set."""
        out: list[tuple[str, str, Any]] = []
        if self.status is not None:
            out.append(("r", "r.status = ?", self.status))
        if self.task:
            out.append(("r", "instr(r.task_id, ?) > 0", self.task))
        if self.failure is not None:
            out.append(("r", "json_extract(r.details, '$.outcome') = ?", self.failure))
        if self.min_reward is not None:
            out.append(("r", "r.reward >= ?", self.min_reward))
        if self.max_reward is not None:
            out.append(("r", "r.reward <= ?", self.max_reward))
        if self.dialect is not None:
            out.append(("s", "s.dialect = ?", self.dialect))
        return out


def page_query(
    run_id: str, sort: str, desc: bool, filters: Filters, limit: int, offset: int
) -> tuple[str, str, list[Any]]:
    """(SQL of the page's rowids, SQL of the filtered count, parameters of the count)."""
    drive, expr = SORTS[sort]
    # A sort key an equality filter pins adds nothing but makes SQLite sort: order by rowid alone.
    pinned = {"status": filters.status, "failure": filters.failure, "dialect": filters.dialect}
    clauses = filters.clauses()
    other = "s" if drive == "r" else "r"
    tables = {"r": "main.rollouts r", "s": "temp.rollout_stats s"}
    source = tables[drive]
    if drive == "s" or any(t == other for t, _, _ in clauses):
        source += f" CROSS JOIN {tables[other]} ON r.rowid = s.rid"
    rowid = "r.rowid" if drive == "r" else "s.rid"
    where = " AND ".join([f"{drive}.run_id = ?", *(sql for _, sql, _ in clauses)])
    params = [run_id, *(p for _, _, p in clauses)]
    direction = "DESC" if desc else "ASC"
    order = (
        f"{rowid} {direction}" if pinned.get(sort) is not None else f"{expr} {direction}, {rowid} {direction}"
    )
    ids_sql = (
        f"SELECT {rowid} FROM {source} WHERE {where} ORDER BY {order} LIMIT {int(limit)} OFFSET {int(offset)}"
    )
    return ids_sql, f"SELECT COUNT(*) FROM {source} WHERE {where}", params


def failure_reason(status: str, details: dict[str, Any], failed_calls: int) -> str:
    """Why a rollout did not end well, in a few words; '' when nothing went wrong."""
    outcome = details.get("outcome")
    if outcome and outcome != "ok":
        return str(outcome)
    if details.get("infra_error"):
        return f"infrastructure: {details['infra_error']}"
    if details.get("interrupted"):
        return "interrupted"
    if status in ("failed", "cancelled"):
        return status
    return f"{failed_calls} failed model call(s)" if failed_calls else ""


class StoreView:
    """One read-only connection to a gateway store (a lock serialises the viewer's threads)."""

    def __init__(self, path: Path, *, create_indexes: bool = False) -> None:
        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"no store at {path}")
        if create_indexes:
            # The one write the viewer ever makes, and only when asked: IF NOT EXISTS is idempotent,
            # and SQLite's busy timeout makes a running gateway's writer wait while the indexes build.
            rw = sqlite3.connect(path, timeout=60)
            try:
                for sql in VIEWER_INDEXES.values():
                    rw.execute(sql)
                rw.commit()
            finally:
                rw.close()
        self._lock = threading.Lock()
        self._db = connect_read_only(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout = 10000")
        self._db.execute("PRAGMA temp_store = MEMORY")
        self._db.executescript(_STATS_SCHEMA)
        self._last_rollout = 0
        self._last_call = 0
        present = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        self.missing_indexes = [name for name in VIEWER_INDEXES if name not in present]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _refresh_stats(self) -> None:
        """Fold the rollouts and calls added since the last refresh into the TEMP stats (lock held)."""
        db = self._db
        db.execute("BEGIN")  # one snapshot: every call read belongs to a rollout read
        try:
            top = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM main.rollouts").fetchone()[0]
            last_call = db.execute("SELECT COALESCE(MAX(id), 0) FROM main.calls").fetchone()[0]
            if self._last_rollout == 0:
                # The first build: one pass joining every rollout to its calls' sums.
                db.execute(
                    "INSERT INTO temp.rollout_stats"
                    " (rid, rollout_id, run_id, turns, tokens, sampled, failed_calls, dialect)"
                    " SELECT r.rowid, r.id, r.run_id, COALESCE(c.n, 0), COALESCE(c.tok, 0),"
                    " COALESCE(c.smp, 0), COALESCE(c.bad, 0),"
                    " CASE WHEN c.lo IS NULL THEN '' WHEN c.lo = c.hi THEN c.lo ELSE 'mixed' END"
                    f" FROM main.rollouts r LEFT JOIN ({_CALL_SUMS} WHERE id <= ? GROUP BY rollout_id) c"
                    " ON c.rollout_id = r.id WHERE r.rowid <= ?",
                    (last_call, top),
                )
            else:
                db.execute(
                    "INSERT INTO temp.rollout_stats (rid, rollout_id, run_id)"
                    " SELECT rowid, id, run_id FROM main.rollouts WHERE rowid > ? AND rowid <= ?",
                    (self._last_rollout, top),
                )
                rows = db.execute(
                    f"{_CALL_SUMS} WHERE id > ? AND id <= ? GROUP BY rollout_id", (self._last_call, last_call)
                ).fetchall()
                db.executemany(
                    "UPDATE temp.rollout_stats SET turns = turns + ?, tokens = tokens + ?,"
                    " sampled = sampled + ?, failed_calls = failed_calls + ?,"
                    " dialect = CASE WHEN dialect IN ('', ?) AND ? = ? THEN ? ELSE 'mixed' END"
                    " WHERE rollout_id = ?",
                    [(n, tok, smp, bad, lo, lo, hi, lo, rid) for rid, n, tok, smp, bad, lo, hi in rows],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._last_rollout, self._last_call = top, last_call

    def run_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT run_id FROM rollouts ORDER BY run_id")]

    def explain(self, sql: str, params: list[Any]) -> list[str]:
        """The query plan's lines (for tests and for checking a new sort key)."""
        with self._lock:
            self._refresh_stats()
            return [r[3] for r in self._db.execute(f"EXPLAIN QUERY PLAN {sql}", params)]

    def page(
        self, run_id: str, *, sort: str, desc: bool, filters: Filters, page: int, page_size: int
    ) -> tuple[int, list[dict[str, Any]]]:
        """The filtered total and one page of rollout rows (1-based pages)."""
        ids_sql, count_sql, params = page_query(
            run_id, sort, desc, filters, page_size, (page - 1) * page_size
        )
        with self._lock:
            self._refresh_stats()
            total = self._db.execute(count_sql, params).fetchone()[0]
            rids = [r[0] for r in self._db.execute(ids_sql, params)]
            rows = self._db.execute(
                "SELECT r.rowid AS rid, r.id, r.task_id, r.status, r.reward, r.details, r.metadata,"
                " r.created_at, r.closed_at, s.turns, s.tokens, s.sampled, s.failed_calls, s.dialect"
                " FROM main.rollouts r JOIN temp.rollout_stats s ON s.rid = r.rowid"
                f" WHERE r.rowid IN ({','.join('?' * len(rids))})",
                rids,
            ).fetchall()
        by_rid = {r["rid"]: r for r in rows}
        return total, [_summary(by_rid[rid]) for rid in rids if rid in by_rid]

    def facets(self, run_id: str) -> dict[str, list[str]]:
        """The values the exact-match filters can take in this run (each read off an index)."""
        with self._lock:
            self._refresh_stats()
            q = self._db.execute
            return {
                "status": [
                    r[0] for r in q("SELECT DISTINCT status FROM rollouts WHERE run_id = ?", (run_id,))
                ],
                "dialect": [
                    r[0]
                    for r in q("SELECT DISTINCT dialect FROM temp.rollout_stats WHERE run_id = ?", (run_id,))
                    if r[0]
                ],
                "failure": [
                    r[0]
                    for r in q(
                        "SELECT DISTINCT json_extract(details, '$.outcome') FROM rollouts WHERE run_id = ?",
                        (run_id,),
                    )
                    if r[0] is not None
                ],
            }

    def rollout(self, rollout_id: str) -> tuple[RolloutRow, list[CallRow], dict[str, Any]] | None:
        """The rollout, its calls in seq order and its stats row."""
        with self._lock:
            self._refresh_stats()
            found = self._db.execute(f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?", (rollout_id,))
            row = found.fetchone()
            if row is None:
                return None
            cols = CALL_COLS if self._has_column("calls", "image_digests") else _OLD_CALL_COLS
            calls = self._db.execute(
                f"SELECT {cols} FROM calls WHERE rollout_id = ? ORDER BY seq", (rollout_id,)
            ).fetchall()
            stats = self._db.execute(
                "SELECT turns, tokens, sampled, failed_calls, dialect FROM temp.rollout_stats"
                " WHERE rollout_id = ?",
                (rollout_id,),
            ).fetchone()
        return rollout_from_row(row), [call_from_row(c) for c in calls], dict(stats) if stats else {}

    def _has_column(self, table: str, column: str) -> bool:
        # Asked on every read, not once: a newer gateway may migrate an old store while it is viewed.
        return any(r["name"] == column for r in self._db.execute(f"PRAGMA main.table_info({table})"))

    def _has_images(self) -> bool:
        found = self._db.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = 'images'")
        return found.fetchone() is not None

    def image_info(self, digests: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Media type, size in pixels and in bytes of the stored images among `digests` (unknown
        ones are absent); the bytes themselves stay in the store."""
        wanted = list(dict.fromkeys(digests))
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            if not wanted or not self._has_images():
                return out
            for i in range(0, len(wanted), IN_CHUNK):
                chunk = wanted[i : i + IN_CHUNK]
                rows = self._db.execute(
                    "SELECT digest, media_type, width, height, length(bytes) AS size FROM images"
                    f" WHERE digest IN ({','.join('?' * len(chunk))})",
                    chunk,
                )
                for r in rows:
                    out[r["digest"]] = {
                        "media_type": r["media_type"],
                        "width": r["width"],
                        "height": r["height"],
                        "size": r["size"],
                    }
        return out

    def image(self, digest: str) -> tuple[str, bytes] | None:
        """One stored image's media type and bytes, or None when the store does not hold it."""
        with self._lock:
            if not self._has_images():
                return None
            found = self._db.execute("SELECT media_type, bytes FROM images WHERE digest = ?", (digest,))
            row = found.fetchone()
        if row is None:
            return None
        media_type = row["media_type"] if row["media_type"] in IMAGE_TYPES else "application/octet-stream"
        return media_type, bytes(row["bytes"])

    def run_totals(self, run_id: str) -> dict[str, Any]:
        """Counts by status, reward mean and pass rate (reward >= 1), rollouts finished per bucket."""
        with self._lock:
            by_status = self._db.execute(
                "SELECT status, COUNT(*) AS n, SUM(reward) AS reward_sum, COUNT(reward) AS scored,"
                " SUM(reward >= 1.0) AS passed, MIN(created_at) AS first, MAX(closed_at) AS last"
                " FROM rollouts WHERE run_id = ? GROUP BY status",
                (run_id,),
            ).fetchall()
            first = min((r["first"] for r in by_status if r["first"] is not None), default=None)
            last = max((r["last"] for r in by_status if r["last"] is not None), default=None)
            # At most ~200 buckets whatever the run's length, a minute at least.
            width = max(60.0, ((last or 0) - (first or 0)) / 200) if first is not None else 60.0
            buckets = self._db.execute(
                "SELECT CAST(closed_at / ? AS INTEGER) AS b, COUNT(*) AS n FROM rollouts"
                " WHERE run_id = ? AND closed_at IS NOT NULL GROUP BY b ORDER BY b",
                (width, run_id),
            ).fetchall()
        # Every bucket from the first to the last, empty ones as 0, and an empty one before the first:
        # a rate needs two points to be drawn.
        counts = {r["b"]: r["n"] for r in buckets}
        span = range(min(counts) - 1, max(counts) + 1) if counts else range(0)
        scored = sum(r["scored"] for r in by_status)
        return {
            "rollouts": sum(r["n"] for r in by_status),
            "by_status": {r["status"]: r["n"] for r in by_status},
            "scored": scored,
            "reward_mean": sum(r["reward_sum"] or 0.0 for r in by_status) / scored if scored else None,
            "pass_rate": sum(r["passed"] or 0 for r in by_status) / scored if scored else None,
            "first_created": first,
            "last_closed": last,
            "throughput": {
                "bucket_seconds": width,
                "t": [b * width for b in span],
                "per_minute": [counts.get(b, 0) * 60.0 / width for b in span],
            },
        }


def _summary(r: sqlite3.Row) -> dict[str, Any]:
    details = orjson.loads(r["details"])
    metadata = orjson.loads(r["metadata"])
    closed = r["closed_at"]
    return {
        "id": r["id"],
        "task_id": r["task_id"],
        "harness": metadata.get("harness", ""),
        "dialect": r["dialect"],
        "status": r["status"],
        "reward": r["reward"],
        "turns": r["turns"],
        "tokens": r["tokens"],
        "sampled": r["sampled"],
        "seconds": None if closed is None else closed - r["created_at"],
        "created_at": r["created_at"],
        "failure": failure_reason(r["status"], details, r["failed_calls"]),
    }
