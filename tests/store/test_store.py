"""The store: a failing write fails alone, the others in its group commit, and all survive a reopen."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from pathlib import Path

import pytest

from openforgerl.store import CallRow, RolloutRow, Store, StoreClosed


def row(rollout_id: str, key: str) -> RolloutRow:
    return RolloutRow(id=rollout_id, run_id="r", task_id="t", key_hash=key, created_at=1.0)


def test_a_bad_write_fails_alone_and_acknowledged_writes_are_durable(tmp_path: Path) -> None:
    async def go() -> list[object]:
        store = Store(tmp_path / "s.db")
        await store.create_rollout(row("ro_0", "k0"))
        # Written together so they share commit groups; one repeats an existing primary key.
        results = await asyncio.gather(
            *[store.create_rollout(row(f"ro_{i}", f"k{i}")) for i in range(1, 40)],
            store.create_rollout(row("ro_0", "other")),
            *[store.create_rollout(row(f"ro_{i}", f"k{i}")) for i in range(40, 80)],
            return_exceptions=True,
        )
        await store.close()
        return results

    results = asyncio.run(go())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], sqlite3.IntegrityError)
    reopened = Store(tmp_path / "s.db")
    try:
        ids = {r.id for r in asyncio.run(reopened.list_rollouts(limit=1000))}
    finally:
        asyncio.run(reopened.close())
    assert ids == {f"ro_{i}" for i in range(80)}


def test_closed_store_refuses_writes_and_reads(tmp_path: Path) -> None:
    async def go() -> None:
        store = Store(tmp_path / "s.db")
        await store.create_rollout(row("ro_0", "k0"))
        assert [r.id for r in await store.list_rollouts()] == ["ro_0"]  # a reader thread's connection
        await store.close()
        with pytest.raises(StoreClosed):
            await store.create_rollout(row("ro_x", "kx"))
        # A read after close would open a connection that nothing closes: refused the same way.
        with pytest.raises(StoreClosed):
            await store.list_rollouts()

    asyncio.run(go())


def test_close_folds_the_wal_into_the_database_file_and_leaves_it_alone(tmp_path: Path) -> None:
    """Readers close with the store: the database file is final when close returns, not whenever
    the garbage collector reaches a reader's connection."""
    path = tmp_path / "s.db"

    async def go() -> Store:
        store = Store(path)
        await store.create_rollout(row("ro_0", "k0"))
        assert [r.id for r in await store.list_rollouts()] == ["ro_0"]  # a reader thread's connection
        await store.close()
        return store

    store = asyncio.run(go())
    assert not path.with_name("s.db-wal").exists()
    stamp = path.stat().st_mtime_ns
    del store
    gc.collect()
    assert path.stat().st_mtime_ns == stamp
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT id FROM rollouts").fetchall() == [("ro_0",)]
    reopened = Store(path)  # what was written is there for the next store on the file
    try:
        assert [r.id for r in asyncio.run(reopened.list_rollouts())] == ["ro_0"]
    finally:
        asyncio.run(reopened.close())


def test_a_response_id_is_kept_with_its_call_and_read_back_up_its_branch(tmp_path: Path) -> None:
    """The Responses API's ids: written in the call's transaction (a call whose id cannot be kept is
    not recorded either), found per rollout only, with the calls the answering call extends."""

    def call(rollout_id: str, seq: int, parent: int | None, response_id: str = "") -> CallRow:
        return CallRow(
            rollout_id=rollout_id, seq=seq, branch_id=0, parent_call_id=parent, branch_reason="",
            dialect="openai-responses", model="m", engine="e", status="ok", error="", policy_version=0,
            prompt_prefix_len=0, prompt_delta=[1], prompt_tokens=1, completion_ids=[2],
            completion_logprobs=[-0.5], finish_reason="stop", stop_reason=None, sampling_requested={},
            sampling_used={}, messages_delta=[{"role": "user", "content": f"q{seq}"}],
            response={"role": "assistant", "content": f"a{seq}"}, parse_errors=[], memory={},
            created_at=1.0, latency_ms=1.0, response_id=response_id,
            response_context={"instructions": False} if response_id else {},
        )  # fmt: skip

    async def go() -> None:
        store = Store(tmp_path / "s.db")
        try:
            await store.create_rollout(row("ro_a", "ka"))
            await store.create_rollout(row("ro_b", "kb"))
            root = await store.record_call(call("ro_a", 0, None))  # another dialect's call: no id
            middle = await store.record_call(call("ro_a", 1, root, "resp_1"))
            tip = await store.record_call(call("ro_a", 2, middle, "resp_2"))
            with pytest.raises(sqlite3.IntegrityError):
                await store.record_call(call("ro_a", 3, tip, "resp_2"))  # the id is taken
            assert [c.seq for c in await store.calls("ro_a")] == [0, 1, 2]
            chain = await asyncio.to_thread(store.response_chain_sync, "ro_a", "resp_2")
            assert [(c.id, c.response_id) for c in chain] == [(tip, "resp_2"), (middle, "resp_1"), (root, "")]
            assert chain[0].response_context == {"instructions": False} and chain[2].response_context == {}
            assert await asyncio.to_thread(store.response_chain_sync, "ro_b", "resp_2") == []
            assert await asyncio.to_thread(store.response_chain_sync, "ro_a", "resp_3") == []
        finally:
            await store.close()

    asyncio.run(go())
