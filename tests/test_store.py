"""The store: a failing write fails alone, the others in its group commit, and all survive a reopen."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from openforgerl.store import RolloutRow, Store, StoreClosed


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


def test_closed_store_refuses_writes(tmp_path: Path) -> None:
    async def go() -> None:
        store = Store(tmp_path / "s.db")
        await store.close()
        with pytest.raises(StoreClosed):
            await store.create_rollout(row("ro_x", "kx"))

    asyncio.run(go())
