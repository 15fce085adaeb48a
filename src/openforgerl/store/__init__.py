"""Runs, rollouts and calls, durably. SQLite (WAL) is the embedded default."""

from openforgerl.store.sqlite import CallRow, RolloutRow, Store, StoreClosed

__all__ = ["CallRow", "RolloutRow", "Store", "StoreClosed"]
