"""The gateway's open rollouts: each a `Session` found by its key or id, created, rebuilt from the store
after a restart (its token memory from its recorded calls), and closed."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from openforgerl.gateway.calls import Session, hash_key
from openforgerl.gateway.errors import bad_request
from openforgerl.gateway.upstream import TextMemory, Upstream
from openforgerl.rendering import ChatRenderer, TokenMemory
from openforgerl.sampling import SamplingPolicy
from openforgerl.store import RolloutRow, Store


class Sessions:
    """The open rollouts by key hash and by id (a closed one is forgotten: it takes no calls)."""

    def __init__(
        self, store: Store, renderer: ChatRenderer, policy: SamplingPolicy, upstreams: Mapping[str, Upstream]
    ) -> None:
        self.store = store
        self.renderer = renderer
        self.policy = policy
        self.upstreams = upstreams
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    async def create(
        self,
        *,
        run_id: str = "",
        task_id: str = "",
        metadata: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        upstream: str = "",
    ) -> tuple[Session, str]:
        try:
            policy = self.policy.merged(sampling)
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc), param="sampling") from exc
        if "upstream" in (metadata or {}):
            raise bad_request("'metadata.upstream' is reserved: give 'upstream' instead.", param="metadata")
        if upstream:
            if upstream not in self.upstreams:
                known = ", ".join(sorted(self.upstreams)) or "none (start the gateway with --upstream)"
                raise bad_request(
                    f"Unknown upstream '{upstream}'; this gateway's upstreams: {known}.", param="upstream"
                )
            metadata = {**(metadata or {}), "upstream": upstream}
        rollout_id = "ro_" + secrets.token_hex(8)
        api_key = "ofk-" + secrets.token_urlsafe(24)
        row = RolloutRow(
            id=rollout_id,
            run_id=run_id,
            task_id=task_id,
            key_hash=hash_key(api_key),
            metadata=metadata or {},
            sampling=sampling or {},
            created_at=time.time(),
        )
        await self.store.create_rollout(row)
        session = Session(row, self._memory(upstream), policy, upstream=upstream)
        self._remember(session)
        return session, api_key

    def _memory(self, upstream: str) -> TokenMemory:
        return TextMemory(self.renderer) if upstream else TokenMemory(self.renderer)

    def _remember(self, session: Session) -> None:
        self._by_key[session.rollout.key_hash] = session
        self._by_id[session.rollout.id] = session

    async def for_key(self, api_key: str) -> Session | None:
        """The open rollout this key belongs to, rebuilt from the store after a restart."""
        key_hash = hash_key(api_key)
        session = self._by_key.get(key_hash)
        if session is not None:
            return session
        row = await self.store.rollout_by_key_hash(key_hash)
        if row is None:
            return None
        return await self._restore(row)

    async def for_id(self, rollout_id: str) -> Session | None:
        session = self._by_id.get(rollout_id)
        if session is not None:
            return session
        row = await self.store.get_rollout(rollout_id)
        return None if row is None else await self._restore(row)

    async def _restore(self, row: RolloutRow) -> Session:
        existing = self._by_id.get(row.id)
        if existing is not None:
            return existing
        if row.status != "open":
            # A closed rollout takes no calls: its row is all an admin update or a refusal needs.
            return Session(row, TokenMemory(self.renderer), self.policy.merged(row.sampling))
        upstream = str(row.metadata.get("upstream") or "")
        memory = self._memory(upstream)
        calls = await self.store.calls(row.id)
        prompts = Store.full_prompts(calls)
        for c in calls:
            assert c.id is not None
            if c.status == "ok" and c.memory:
                memory.restore(c.id, c.branch_id, c.memory, prompts[c.id] + c.completion_ids)
            memory.next_branch_id = max(memory.next_branch_id, c.branch_id + 1)
        session = Session(
            row, memory, self.policy.merged(row.sampling), next_seq=len(calls), upstream=upstream
        )
        self._remember(session)
        return session

    async def close(
        self, session: Session, *, status: str, reward: float | None, details: dict[str, Any] | None
    ) -> RolloutRow:
        row = await self.store.update_rollout(
            session.rollout.id, status=status, reward=reward, details=details
        )
        assert row is not None
        session.rollout = row
        # A closed rollout takes no more calls; its token memory is no longer needed.
        self._by_key.pop(row.key_hash, None)
        self._by_id.pop(row.id, None)
        return row
