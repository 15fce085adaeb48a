"""The embedded store: SQLite in WAL mode with group commit.

One writer thread owns the write connection. Writers hand it operations and await a future
that resolves only after the transaction holding their operation has committed (and, with
`durability="full"`, been fsynced), so a call acknowledged to a harness is on disk. Batching
every operation that queued up meanwhile into one transaction keeps fsyncs rare under load.

Token ids are stored as little-endian int32 blobs and logprobs as float32 blobs. A call whose
prompt extends an earlier call (token memory) stores only the reference to that call and the
newly appended ids, so storage grows with the new tokens, not with the whole history.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from openforgerl.images import Image
from openforgerl.jsonutil import dumps
from openforgerl.store.records import CallRow, RolloutRow, full_prompts

# The indexes the viewer sorts and filters a run's rollouts by (fast paging at 100,000 rollouts), by
# name: part of SCHEMA, and what `openforge view --create-indexes` adds to a store made before them.
VIEWER_INDEXES = {
    "rollouts_run_task": "CREATE INDEX IF NOT EXISTS rollouts_run_task ON rollouts(run_id, task_id)",
    "rollouts_run_status": "CREATE INDEX IF NOT EXISTS rollouts_run_status ON rollouts(run_id, status)",
    "rollouts_run_reward": "CREATE INDEX IF NOT EXISTS rollouts_run_reward ON rollouts(run_id, reward)",
    "rollouts_run_seconds": (
        "CREATE INDEX IF NOT EXISTS rollouts_run_seconds ON rollouts(run_id, closed_at - created_at)"
    ),
    "rollouts_run_outcome": (
        "CREATE INDEX IF NOT EXISTS rollouts_run_outcome"
        " ON rollouts(run_id, json_extract(details, '$.outcome'))"
    ),
}

_TABLES = """
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL DEFAULT '',
    task_id TEXT NOT NULL DEFAULT '',
    key_hash TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL DEFAULT 'open',
    reward REAL,
    details TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}',
    sampling TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    closed_at REAL
);
CREATE INDEX IF NOT EXISTS rollouts_run ON rollouts(run_id, created_at);
-- The viewer's indexes on rollouts (VIEWER_INDEXES) are added after the tables.
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL REFERENCES rollouts(id),
    seq INTEGER NOT NULL,
    branch_id INTEGER NOT NULL,
    parent_call_id INTEGER,
    branch_reason TEXT NOT NULL DEFAULT '',
    dialect TEXT NOT NULL,
    model TEXT NOT NULL,
    engine TEXT NOT NULL,
    status TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    policy_version INTEGER,
    prompt_prefix_len INTEGER NOT NULL DEFAULT 0,
    prompt_delta BLOB NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_ids BLOB NOT NULL,
    completion_logprobs BLOB NOT NULL,
    finish_reason TEXT,
    stop_reason TEXT,
    sampling_requested TEXT NOT NULL,
    sampling_used TEXT NOT NULL,
    messages_delta TEXT NOT NULL,
    response TEXT NOT NULL,
    parse_errors TEXT NOT NULL DEFAULT '[]',
    memory TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    latency_ms REAL NOT NULL,
    image_digests TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls(rollout_id, seq);
-- Each image once, however many calls show it (calls name them by digest, in image_digests).
CREATE TABLE IF NOT EXISTS images (
    digest TEXT PRIMARY KEY,
    media_type TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    bytes BLOB NOT NULL,
    created_at REAL NOT NULL
);
-- A dialect's id for the response an ok call answered (the Responses API's `resp_...`), scoped to
-- the rollout, with what continuing from it needs beyond the call's own record (written in the
-- call's transaction): `previous_response_id` is served from here once memory has lost it.
CREATE TABLE IF NOT EXISTS responses (
    call_id INTEGER PRIMARY KEY REFERENCES calls(id),
    rollout_id TEXT NOT NULL,
    id TEXT NOT NULL,
    context TEXT NOT NULL DEFAULT '{}'
);
CREATE UNIQUE INDEX IF NOT EXISTS responses_id ON responses(rollout_id, id);
-- Which rollout uploaded which image (POST /v1/files): a file is visible to its uploader only, so
-- a key cannot read another rollout's bytes, nor learn that somebody uploaded a given picture.
CREATE TABLE IF NOT EXISTS uploads (
    rollout_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (rollout_id, digest)
);
"""
SCHEMA = _TABLES + "".join(f"{sql};\n" for sql in VIEWER_INDEXES.values())

# Columns added since the first schema, with their definitions: an older database gets them on open.
_ADDED_COLUMNS = {"calls": {"image_digests": "TEXT NOT NULL DEFAULT '[]'"}}


def ids_to_blob(ids: Sequence[int]) -> bytes:
    return array("i", ids).tobytes()


def floats_to_blob(values: Sequence[float]) -> bytes:
    return array("f", values).tobytes()


def blob_to_ids(blob: bytes) -> list[int]:
    return _unpack("i", blob)


def blob_to_floats(blob: bytes) -> list[float]:
    return _unpack("f", blob)


def _unpack(typecode: str, blob: bytes) -> list[Any]:
    values = array(typecode)
    values.frombytes(blob)
    return values.tolist()


ROLLOUT_COLS = (
    "id, run_id, task_id, key_hash, status, reward, details, metadata, sampling, created_at, closed_at"
)
CALL_COLS = (
    "id, rollout_id, seq, branch_id, parent_call_id, branch_reason, dialect, model, engine, status, error, "
    "policy_version, prompt_prefix_len, prompt_delta, prompt_tokens, completion_ids, completion_logprobs, "
    "finish_reason, stop_reason, sampling_requested, sampling_used, messages_delta, response, parse_errors, "
    "memory, created_at, latency_ms, image_digests"
)
IMAGE_COLS = "digest, media_type, width, height, bytes, created_at"
# A call with the response it answered, if any (`calls AS c LEFT JOIN responses AS r`).
_CALL_WITH_RESPONSE = (
    ", ".join(f"c.{col}" for col in CALL_COLS.split(", "))
    + ", r.id AS response_id, r.context AS response_context"
)
_IMAGES_REMEMBERED = 200_000  # digests known to be stored, kept to skip rewriting their bytes
IN_CHUNK = 500  # digests per `IN (...)` query, below SQLite's limit on parameters


# How a column's stored value becomes its record's field (other columns are stored as they are).
_DECODE: dict[str, Callable[[Any], Any]] = {
    "prompt_delta": blob_to_ids,
    "completion_ids": blob_to_ids,
    "completion_logprobs": blob_to_floats,
    **dict.fromkeys(("details", "metadata", "sampling"), orjson.loads),
    **dict.fromkeys(("sampling_requested", "sampling_used", "messages_delta", "response"), orjson.loads),
    **dict.fromkeys(("parse_errors", "memory", "image_digests"), orjson.loads),
    # A call's response (`_CALL_WITH_RESPONSE`), NULL when it answered none.
    "response_id": lambda value: value or "",
    "response_context": lambda value: orjson.loads(value or "{}"),
}


def _fields(r: sqlite3.Row) -> dict[str, Any]:
    return {k: _DECODE[k](v) if k in _DECODE else v for k, v in zip(r.keys(), r, strict=True)}


def rollout_from_row(r: sqlite3.Row) -> RolloutRow:
    """A row of `ROLLOUT_COLS` as its record."""
    return RolloutRow(**_fields(r))


def call_from_row(r: sqlite3.Row) -> CallRow:
    """A row of `CALL_COLS` (and, optionally, the response it answered) as its record."""
    return CallRow(**_fields(r))


def connect_read_only(path: Path, **options: Any) -> sqlite3.Connection:
    """A connection that cannot write the database at `path` (a `mode=ro` URI); rows by name."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, **options)
    conn.row_factory = sqlite3.Row
    return conn


class StoreClosed(RuntimeError):
    pass


_Op = Callable[[sqlite3.Connection], Any]


class Store:
    """Durable store of rollouts and calls. Writes are group-committed on a writer thread."""

    def __init__(self, path: str | Path, durability: str = "full") -> None:
        if durability not in ("full", "normal"):
            raise ValueError("durability must be 'full' (fsync every commit) or 'normal'")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._durability = durability
        self._queue: queue.SimpleQueue[tuple[_Op, asyncio.Future[Any] | None] | None] = queue.SimpleQueue()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []  # closed with the store, not left to the GC
        self._readers_lock = threading.Lock()
        write = self._connect()
        write.executescript(SCHEMA)
        _migrate(write)
        write.commit()
        # Digests known to be in the images table: a call showing them again sends no bytes.
        self._stored_images: set[str] = set()
        self._writer = threading.Thread(
            target=self._write_loop, args=(write,), name="store-writer", daemon=True
        )
        self._closed = False
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._durability.upper()}")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    # -- writing -------------------------------------------------------------------------
    def _write_loop(self, conn: sqlite3.Connection) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= 512:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            else:
                stop = True
            if batch:
                self._commit_batch(conn, batch)
        conn.close()

    def _commit_batch(
        self, conn: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any] | None]]
    ) -> None:
        results: list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]]
        try:
            # The common case: every operation succeeds, one transaction, no per-operation cost.
            conn.execute("BEGIN IMMEDIATE")
            results = [(fut, op(conn), None) for op, fut in batch]
            conn.execute("COMMIT")
        except Exception:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            results = self._commit_one_by_one(conn, batch)
        for fut, value, error in results:
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(_resolve, fut, value, error)

    @staticmethod
    def _commit_one_by_one(
        conn: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any] | None]]
    ) -> list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]]:
        """The batch again, a savepoint per operation: a bad one fails alone, the rest commit."""
        results: list[tuple[asyncio.Future[Any] | None, Any, BaseException | None]] = []
        conn.execute("BEGIN IMMEDIATE")
        for op, fut in batch:
            conn.execute("SAVEPOINT op")
            try:
                results.append((fut, op(conn), None))
                conn.execute("RELEASE op")
            except Exception as exc:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                results.append((fut, None, exc))
        try:
            conn.execute("COMMIT")
        except Exception as commit_error:  # disk full, I/O error: every writer in the batch learns of it
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            results = [(fut, None, commit_error) for fut, _, _ in results]
        return results

    async def _write(self, op: _Op) -> Any:
        if self._closed:
            raise StoreClosed("the store is closed")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put((op, fut))
        return await fut

    # -- reading: one connection per reader thread, WAL lets them run beside the writer ----
    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            with self._readers_lock:  # checked under the lock close() takes: no reader outlives it
                if self._closed:
                    raise StoreClosed("the store is closed")
                conn = self._connect()
                self._local.conn = conn
                self._readers.append(conn)
        return conn

    def _read_sync(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        return self._reader().execute(sql, tuple(params)).fetchall()

    async def _read(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        return await asyncio.to_thread(self._read_sync, sql, tuple(params))

    # -- rollouts ------------------------------------------------------------------------
    async def create_rollout(self, row: RolloutRow) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                f"INSERT INTO rollouts ({ROLLOUT_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row.id,
                    row.run_id,
                    row.task_id,
                    row.key_hash,
                    row.status,
                    row.reward,
                    dumps(row.details),
                    dumps(row.metadata),
                    dumps(row.sampling),
                    row.created_at,
                    row.closed_at,
                ),
            )

        await self._write(op)

    async def update_rollout(
        self,
        rollout_id: str,
        *,
        status: str | None = None,
        reward: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> RolloutRow | None:
        def op(conn: sqlite3.Connection) -> None:
            sets: list[str] = []
            params: list[Any] = []
            if status is not None:
                sets += ["status=?", "closed_at=?"]
                params += [status, time.time() if status != "open" else None]
            if reward is not None:
                sets.append("reward=?")
                params.append(reward)
            if details is not None:
                sets.append("details=?")
                params.append(dumps(details))
            if sets:
                conn.execute(f"UPDATE rollouts SET {', '.join(sets)} WHERE id=?", (*params, rollout_id))

        await self._write(op)
        return await self.get_rollout(rollout_id)

    async def get_rollout(self, rollout_id: str) -> RolloutRow | None:
        rows = await self._read(f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id=?", (rollout_id,))
        return rollout_from_row(rows[0]) if rows else None

    async def rollout_by_key_hash(self, key_hash: str) -> RolloutRow | None:
        rows = await self._read(f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE key_hash=?", (key_hash,))
        return rollout_from_row(rows[0]) if rows else None

    async def list_rollouts(
        self, *, run_id: str | None = None, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[RolloutRow]:
        where, params = [], []
        if run_id is not None:
            where.append("run_id=?")
            params.append(run_id)
        if status is not None:
            where.append("status=?")
            params.append(status)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._read(
            f"SELECT {ROLLOUT_COLS} FROM rollouts {clause} ORDER BY created_at, id LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        return [rollout_from_row(r) for r in rows]

    # -- images --------------------------------------------------------------------------
    def _insert_images(self, conn: sqlite3.Connection, images: Sequence[Image]) -> None:
        now = time.time()
        conn.executemany(
            f"INSERT OR IGNORE INTO images ({IMAGE_COLS}) VALUES (?,?,?,?,?,?)",
            [
                (im.digest, im.media_type, im.width, im.height, im.data, now)
                for im in {im.digest: im for im in images if im.digest not in self._stored_images}.values()
            ],
        )

    async def put_images(self, images: Sequence[Image]) -> None:
        """Keep images (uploads) by digest; an image already kept is left as it is."""
        await self._write(lambda conn: self._insert_images(conn, images))
        self._remember_images(images)

    def _remember_images(self, images: Sequence[Image]) -> None:
        if len(self._stored_images) > _IMAGES_REMEMBERED:  # only a shortcut: forgetting costs a rewrite
            self._stored_images.clear()
        self._stored_images.update(im.digest for im in images)

    def images_sync(self, digests: Iterable[str]) -> dict[str, Image]:
        """The kept images among `digests` (unknown ones are absent), for readers in threads."""
        wanted = list(dict.fromkeys(digests))
        out: dict[str, Image] = {}
        for i in range(0, len(wanted), IN_CHUNK):
            chunk = wanted[i : i + IN_CHUNK]
            rows = self._read_sync(
                f"SELECT {IMAGE_COLS} FROM images WHERE digest IN ({','.join('?' * len(chunk))})", chunk
            )
            for r in rows:
                out[r["digest"]] = Image(r["digest"], r["media_type"], r["width"], r["height"], r["bytes"])
        return out

    async def images(self, digests: Iterable[str]) -> dict[str, Image]:
        return await asyncio.to_thread(self.images_sync, list(digests))

    async def put_upload(self, rollout_id: str, image: Image) -> float:
        """Keep an image a rollout uploaded; returns when it was first uploaded by that rollout."""

        def op(conn: sqlite3.Connection) -> float:
            self._insert_images(conn, [image])
            conn.execute(
                "INSERT OR IGNORE INTO uploads (rollout_id, digest, created_at) VALUES (?,?,?)",
                (rollout_id, image.digest, time.time()),
            )
            row = conn.execute(
                "SELECT created_at FROM uploads WHERE rollout_id=? AND digest=?", (rollout_id, image.digest)
            ).fetchone()
            return float(row[0])

        created: float = await self._write(op)
        self._remember_images([image])
        return created

    def _uploads_sync(self, rollout_id: str, digests: list[str]) -> dict[str, tuple[Image, float]]:
        out: dict[str, tuple[Image, float]] = {}
        for i in range(0, len(digests), IN_CHUNK):
            chunk = digests[i : i + IN_CHUNK]
            rows = self._read_sync(
                "SELECT i.digest, i.media_type, i.width, i.height, i.bytes, u.created_at AS uploaded "
                "FROM uploads u JOIN images i ON i.digest = u.digest "
                f"WHERE u.rollout_id=? AND u.digest IN ({','.join('?' * len(chunk))})",
                (rollout_id, *chunk),
            )
            for r in rows:
                image = Image(r["digest"], r["media_type"], r["width"], r["height"], r["bytes"])
                out[r["digest"]] = (image, float(r["uploaded"]))
        return out

    async def uploads(self, rollout_id: str, digests: Iterable[str]) -> dict[str, tuple[Image, float]]:
        """The images among `digests` that this rollout uploaded, with when it uploaded each."""
        return await asyncio.to_thread(self._uploads_sync, rollout_id, list(dict.fromkeys(digests)))

    # -- calls ---------------------------------------------------------------------------
    async def record_call(self, call: CallRow, images: Sequence[Image] = ()) -> int:
        """Insert a call; returns its id once the transaction holding it is durable. `images` are the
        images its `image_digests` name: new ones are kept in the same transaction, so a recorded call
        never names an image the store lacks."""
        missing = set(call.image_digests) - {im.digest for im in images} - self._stored_images
        if missing:
            raise ValueError(f"call names images it does not carry: {sorted(missing)}")

        def op(conn: sqlite3.Connection) -> int:
            self._insert_images(conn, images)
            cur = conn.execute(
                f"INSERT INTO calls ({CALL_COLS}) VALUES ({','.join('?' * 28)})",
                (
                    None,
                    call.rollout_id,
                    call.seq,
                    call.branch_id,
                    call.parent_call_id,
                    call.branch_reason,
                    call.dialect,
                    call.model,
                    call.engine,
                    call.status,
                    call.error,
                    call.policy_version,
                    call.prompt_prefix_len,
                    ids_to_blob(call.prompt_delta),
                    call.prompt_tokens,
                    ids_to_blob(call.completion_ids),
                    floats_to_blob(call.completion_logprobs),
                    call.finish_reason,
                    call.stop_reason,
                    dumps(call.sampling_requested),
                    dumps(call.sampling_used),
                    dumps(call.messages_delta),
                    dumps(call.response),
                    dumps(call.parse_errors),
                    dumps(call.memory),
                    call.created_at,
                    call.latency_ms,
                    dumps(call.image_digests),
                ),
            )
            assert cur.lastrowid is not None
            if call.response_id:
                conn.execute(
                    "INSERT INTO responses (call_id, rollout_id, id, context) VALUES (?,?,?,?)",
                    (cur.lastrowid, call.rollout_id, call.response_id, dumps(call.response_context)),
                )
            return cur.lastrowid

        call_id: int = await self._write(op)
        self._remember_images(images)
        call.id = call_id
        return call_id

    async def calls(self, rollout_id: str) -> list[CallRow]:
        rows = await self._read(
            f"SELECT {CALL_COLS} FROM calls WHERE rollout_id=? ORDER BY seq", (rollout_id,)
        )
        return [call_from_row(r) for r in rows]

    def response_chain_sync(self, rollout_id: str, response_id: str) -> list[CallRow]:
        """The call of this rollout that answered `response_id`, then the calls its prompt extends,
        parent after parent up to where its branch began (nearest first), each with its response's
        id and context when it has one; [] when the rollout has no such response. For readers in
        threads."""
        rows = self._read_sync(
            f"SELECT {_CALL_WITH_RESPONSE} FROM responses r JOIN calls c ON c.id = r.call_id "
            "WHERE r.rollout_id=? AND r.id=?",
            (rollout_id, response_id),
        )
        chain: list[CallRow] = []
        seen: set[int] = set()
        while rows:
            call = call_from_row(rows[0])
            chain.append(call)
            assert call.id is not None
            seen.add(call.id)
            if call.parent_call_id is None or call.parent_call_id in seen:
                break
            rows = self._read_sync(
                f"SELECT {_CALL_WITH_RESPONSE} FROM calls c LEFT JOIN responses r ON r.call_id = c.id "
                "WHERE c.id=? AND c.rollout_id=?",
                (call.parent_call_id, rollout_id),
            )
        return chain

    # Each call's full prompt ids, rebuilt from the prefix references (records.full_prompts).
    full_prompts = staticmethod(full_prompts)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._writer.join)
        # The last connection to close folds the WAL into the database file. Closing the readers
        # here makes that happen now, not whenever the garbage collector reaches them (when the
        # file would change under a caller that thinks the store is done with it).
        with self._readers_lock:
            readers, self._readers = self._readers, []
            self._local = threading.local()  # a read after close finds no connection: StoreClosed
        for conn in readers:
            conn.close()


def _migrate(conn: sqlite3.Connection) -> None:
    """Add the columns a database made by an older version lacks (new tables come from SCHEMA)."""
    for table, columns in _ADDED_COLUMNS.items():
        have = {r["name"] for r in conn.execute(f"PRAGMA table_info({table})")}
        for name, definition in columns.items():
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")


def _resolve(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
