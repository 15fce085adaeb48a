"""The gateway's admin API as the rollouts package uses it, typed: the one place that speaks it.

    async with AdminClient(url, admin_token) as admin:
        opened = await admin.open_rollout(run_id, task_id, metadata={"sample": 0}, sampling={})
        ...                                   # the harness calls opened.api_key's base URL
        calls = await admin.calls(opened.rollout_id)            # list[RecordedCall] | None
        await admin.close_rollout(opened.rollout_id, reward=1.0, details={}, status="closed")

`calls` is the only reader of `GET /admin/rollouts/{id}/calls` in the product: the runner reads a
rollout's calls once, at close, and the service (service.py) reads them for rollouts finished by an
earlier process. The reward goes to the gateway only as a copy for the recording's readers (the
viewer, `openforge export-sft`): eval and training read it from the runner's result (results.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from openforgerl.rollouts.trajectory import RecordedCall, calls_from_json

CALLS_TIMEOUT_S = 120.0  # a long rollout's calls are many megabytes of JSON
# A pooled connection idle this long is not reused: uvicorn closes idle ones after 5 s, httpx would
# reuse them up to 5 s, and a request sent as the server closes fails ("Server disconnected"). A
# rollout of about 5 s met that between opening its gateway rollout and reading its calls.
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True, slots=True)
class OpenedRollout:
    """A rollout the gateway opened: its id, and the key its harness calls with."""

    rollout_id: str
    api_key: str


class AdminClient:
    """An async client of one gateway's admin API (`Authorization: Bearer ADMIN_TOKEN`)."""

    def __init__(self, url: str, admin_token: str, timeout: float = 60.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"authorization": f"Bearer {admin_token}"},
            timeout=timeout,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def open_rollout(
        self, run_id: str, task_id: str, metadata: Mapping[str, Any], sampling: Mapping[str, Any]
    ) -> OpenedRollout:
        """Open a rollout of `run_id` for `task_id` with per-rollout `sampling` overrides."""
        body = {"run_id": run_id, "task_id": task_id, "metadata": dict(metadata), "sampling": dict(sampling)}
        resp = await self._http.post("/admin/rollouts", json=body)
        resp.raise_for_status()
        opened = resp.json()
        return OpenedRollout(opened["rollout_id"], opened["api_key"])

    async def queue_faults(self, rollout_id: str, statuses: Sequence[int]) -> None:
        """The rollout's next calls are answered with these HTTP errors (a task's gateway faults)."""
        resp = await self._http.post(f"/admin/rollouts/{rollout_id}/faults", json={"errors": list(statuses)})
        resp.raise_for_status()

    async def calls(self, rollout_id: str) -> list[RecordedCall] | None:
        """The rollout's recorded calls, in the order they were made; None when the gateway cannot
        say (unreachable, or it has no such rollout)."""
        url = f"/admin/rollouts/{rollout_id}/calls"
        try:
            try:
                resp = await self._http.get(url, timeout=CALLS_TIMEOUT_S)
            except (httpx.RemoteProtocolError, httpx.ReadError):  # a pooled connection closed under it
                resp = await self._http.get(url, timeout=CALLS_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return calls_from_json(resp.json()) if resp.status_code == 200 else None

    async def close_rollout(
        self, rollout_id: str, reward: float | None, details: Mapping[str, Any], status: str
    ) -> None:
        """Close the rollout (`status`: closed, failed or cancelled), its key dead from now on, with a
        copy of the reward for the recording's readers. A gateway that is gone is not an error here:
        the runner's state holds the result."""
        body: dict[str, Any] = {"details": dict(details), "status": status}
        if reward is not None:
            body["reward"] = reward
        try:
            await self._http.post(f"/admin/rollouts/{rollout_id}/close", json=body)
        except httpx.HTTPError:
            pass
