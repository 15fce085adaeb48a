"""Runs, rollouts and calls, durably. SQLite (WAL) is the embedded default.

`Store` writes (and reads, for the gateway); `StoreView` (store.view) is the read-only access the
viewer uses; `public_calls` gives recorded calls in the one shape every reader hands on (the admin
API, the viewer, the SFT export); `run_state_progress` and `run_state_record` read a runner's own
record of its rollouts (runner.db), read-only.
"""

from openforgerl.store.records import CallRow, RolloutRow, full_prompts, public_calls
from openforgerl.store.run_state import run_state_progress, run_state_record
from openforgerl.store.sqlite import Store, StoreClosed
from openforgerl.store.view import StoreView

__all__ = [
    "CallRow",
    "RolloutRow",
    "Store",
    "StoreClosed",
    "StoreView",
    "full_prompts",
    "public_calls",
    "run_state_progress",
    "run_state_record",
]
