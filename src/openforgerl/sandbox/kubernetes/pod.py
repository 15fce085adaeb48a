"""One rollout's sandbox: its Pod created, watched until ready and deleted; its commands through the
exec API; who killed a command that nothing here killed (`_blame`)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

import aiohttp
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from openforgerl.sandbox import base, container
from openforgerl.sandbox.base import SandboxError, SandboxSpec, SandboxStartError, SandboxUnavailable
from openforgerl.sandbox.kubernetes.api import PERMISSIONS, Session, denied_permissions, unavailable
from openforgerl.sandbox.kubernetes.manifests import (
    CONTAINER,
    KubernetesConfig,
    PodState,
    assess,
    pod_manifest,
    pod_name,
)
from openforgerl.sandbox.kubernetes.streams import exit_code, pump

log = logging.getLogger(__name__)

# The memory cgroup's OOM kill count, as the container sees its own cgroup (v1, else v2).
_OOM_KILLS = "cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null || cat /sys/fs/cgroup/memory.events"


class PodHost(Protocol):
    """What a sandbox reads of its backend (`backend.py` KubernetesBackend): the run's configuration,
    and the session it shares with the backend's other sandboxes on this event loop."""

    name: str
    cfg: KubernetesConfig

    @property
    def isolation(self) -> str: ...

    async def _acquire(self) -> Session: ...

    async def _release(self) -> None: ...


class KubernetesSandbox(container.ContainerSandbox):
    """A sandbox of `KubernetesBackend`: see the module's doc. Its network "gateway" (and "host" short
    of the cluster's private addresses) holds only where deploy/kubernetes' NetworkPolicies are applied
    (doctor checks it)."""

    def __init__(self, backend: PodHost, spec: SandboxSpec, name: str) -> None:
        super().__init__(
            spec, name, image=backend.cfg.image, isolation=backend.isolation, backend_name=backend.name
        )
        self.backend = backend
        self.pod = pod_name(backend.cfg, name)
        self._session: Session | None = None
        self._holds_slot = False
        self._created = False
        self._oom_kills = 0  # the memory cgroup's OOM kills seen so far (a new Pod's count is 0)

    @property
    def gateway_url(self) -> str | None:
        if self.spec.network == "none":
            return None
        return self.backend.cfg.gateway_url or self.spec.gateway_url

    @property
    def _cfg(self) -> KubernetesConfig:
        return self.backend.cfg

    # -- lifecycle ----------------------------------------------------------------------------------

    async def _provision(self) -> None:
        self._session = await self.backend._acquire()
        await self._session.pods.acquire()
        self._holds_slot = True
        await self._create(self._session)
        await self._until_ready(self._session)

    async def _create(self, session: Session) -> None:
        await session.limiter.wait()
        uid = await session.parent_uid()
        body = pod_manifest(self._cfg, self.spec, self.name, uid)
        core = session.core
        try:
            await session.call(
                f"create pod {self.pod}",
                lambda: core.create_namespaced_pod(self._cfg.namespace, cast(Any, body)),
            )
        except ApiException as e:
            if e.status != 409:
                raise unavailable(f"cannot create pod {self.pod}", e) from e
            # An earlier try whose answer was lost got through: the name is this sandbox's alone.
            log.info("pod %s: created by an earlier try", self.pod)
        self._created = True

    async def _read(self, session: Session) -> dict[str, Any] | None:
        core = session.core
        try:
            pod = await session.call(
                f"read pod {self.pod}", lambda: core.read_namespaced_pod(self.pod, self._cfg.namespace)
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise unavailable(f"cannot read pod {self.pod}", e) from e
        # The API's own JSON (camelCase), which `assess` reads.
        assert session.api is not None
        return cast(dict[str, Any], session.api.sanitize_for_serialization(pod))

    async def _until_ready(self, session: Session) -> None:
        """Waits for the Pod to be ready, watching it; raises SandboxStartError when it cannot be."""
        deadline = time.monotonic() + self._cfg.start_timeout_s
        why = f"pod {self.pod} not scheduled yet"
        while (left := deadline - time.monotonic()) > 0:
            pod = await self._read(session)
            if pod is None:
                raise SandboxStartError(f"pod {self.pod} was deleted before it was ready")
            state, why = assess(pod)
            if state is PodState.READY:
                return
            if state is not PodState.PENDING:
                raise SandboxStartError(f"sandbox {self.name} did not start: {why}")
            w = watch.Watch()
            try:
                async with asyncio.timeout(left):
                    async for event in w.stream(
                        session.core.list_namespaced_pod,
                        self._cfg.namespace,
                        field_selector=f"metadata.name={self.pod}",
                        resource_version=pod["metadata"]["resourceVersion"],
                        timeout_seconds=max(1, min(int(left), 300)),
                    ):
                        if event["type"] == "DELETED":
                            raise SandboxStartError(f"pod {self.pod} was deleted before it was ready")
                        state, why = assess(event["raw_object"])
                        if state is PodState.READY:
                            return
                        if state is not PodState.PENDING:
                            raise SandboxStartError(f"sandbox {self.name} did not start: {why}")
            except TimeoutError:
                break
            except (ApiException, aiohttp.ClientError) as e:
                # An expired resourceVersion (410) or a dropped watch: read the Pod again, watch anew.
                log.debug("pod %s: watch ended: %s", self.pod, str(e).splitlines()[0])
                await asyncio.sleep(0.5)
            finally:
                await w.close()
        warning = await self._last_warning(session)
        raise SandboxStartError(
            f"sandbox {self.name} not ready after {self._cfg.start_timeout_s:.0f} s: {why}"
            + (f"; the Pod's last warning: {warning}" if warning else "")
        )

    async def _last_warning(self, session: Session) -> str | None:
        """The Pod's last Warning event, a failure first, in words: what a Pod stuck in
        ContainerCreating shows nowhere else (its sandbox or volumes failing again and again, as
        `kubectl describe` shows). None where there is none, or events may not be listed (RBAC)."""
        try:
            events = await session.core.list_namespaced_event(
                self._cfg.namespace, field_selector=f"involvedObject.name={self.pod},type=Warning"
            )
        except (ApiException, aiohttp.ClientError) as e:
            log.debug("pod %s: no events: %s", self.pod, str(e).splitlines()[0])
            return None
        if not events.items:
            return None
        # A failure (FailedCreatePodSandBox, FailedMount, BackOff, ...) over advice such as
        # MissingClusterDNS, which a node without cluster DNS attaches to every Pod; then the latest.
        last = max(
            events.items,
            key=lambda e: (
                "Fail" in (e.reason or "") or "BackOff" in (e.reason or ""),
                e.last_timestamp or e.event_time or e.metadata.creation_timestamp,
            ),
        )
        times = f" ({last.count} times)" if (last.count or 1) > 1 else ""
        return f"{last.reason}{times}: {(last.message or '').strip()[:500]}"

    async def _teardown(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None and self._created:
                core = session.core
                try:
                    await session.call(
                        f"delete pod {self.pod}",
                        lambda: core.delete_namespaced_pod(
                            self.pod, self._cfg.namespace, grace_period_seconds=0
                        ),
                    )
                except ApiException as e:
                    if e.status != 404:
                        raise SandboxError(f"pod {self.pod} left behind: {e.status} {e.reason}") from e
        finally:
            if session is not None:
                if self._holds_slot:
                    session.pods.release()
                await self.backend._release()

    # -- exec ------------------------------------------------------------------------------------

    async def _stream(
        self, argv: Sequence[str], stdin: container.Stdin | None, output: base.Output, wait_s: float | None
    ) -> int:
        """Runs argv through the exec API; raises StreamLost when no exit status came back."""
        session = self._session
        assert session is not None
        api = session.exec_api

        async def connect() -> Any:
            ws = await cast(Any, api).connect_get_namespaced_pod_exec(
                self.pod,
                self._cfg.namespace,
                container=CONTAINER,
                command=list(argv),
                stdin=stdin is not None,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
            )
            return await ws.__aenter__()

        try:
            ws = await session.call(f"exec in pod {self.pod}", connect)
        except aiohttp.WSServerHandshakeError as e:
            if e.status == 403:
                raise SandboxUnavailable(await self._exec_forbidden(session)) from e
            raise container.StreamLost(f"exec refused: {e.status} {e.message}") from e
        status = bytearray()

        reading = asyncio.ensure_future(pump(ws, stdin, output, status))
        ended = asyncio.ensure_future(self._until_pod_ends(session))
        try:
            done, _ = await asyncio.wait(
                {reading, ended}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            if reading in done:
                reading.result()
            elif ended in done:
                raise container.StreamLost(f"the Pod ended under the command: {ended.result()}")
            else:
                raise container.StreamLost(f"no answer {wait_s:.0f} s into the command")
        except aiohttp.ClientError as e:
            raise container.StreamLost(f"the exec stream broke: {e}") from e
        finally:
            for task in (reading, ended):
                task.cancel()
            await asyncio.gather(reading, ended, return_exceptions=True)
            await ws.close()
        if not status:
            raise container.StreamLost("the exec stream ended without an exit status")
        return exit_code(bytes(status))

    async def _until_pod_ends(self, session: Session) -> str:
        """Returns why, once the Pod can no longer run a command (past its deadline, evicted, deleted):
        a real kubelet (1.20, dockershim) kills the containers but may leave the exec stream open, so
        the Pod is read every `pod_check_s` while a command runs (a short command reads it never)."""
        while True:
            await asyncio.sleep(self._cfg.pod_check_s)
            try:
                pod = await self._read(session)
            except SandboxError as e:  # the API's trouble: the stream itself, or its wait, decides
                log.debug("pod %s: not read during a command: %s", self.pod, e)
                continue
            if pod is None:
                return f"pod {self.pod} is gone"
            state, why = assess(pod)
            if state not in (PodState.READY, PodState.PENDING):
                return why

    async def _exec_forbidden(self, session: Session) -> str:
        """Why exec was refused, naming the permissions: a refused WebSocket handshake carries no
        reason (aiohttp keeps only the status), so the API server is asked what is missing."""
        ns = self._cfg.namespace
        wanted = [p for p in PERMISSIONS if p[1:] == ("pods", "exec")]
        try:
            assert session.api is not None
            denied = await denied_permissions(session.api, ns, wanted)
        except (ApiException, aiohttp.ClientError) as e:
            denied = [f"(unknown: the access review failed: {str(e).splitlines()[0]})"]
        missing = ", ".join(denied) or "nothing an access review sees (an admission webhook?)"
        return (
            f"exec in pod {self.pod} forbidden: not allowed in namespace {ns}: {missing} "
            "(deploy/kubernetes/rbac.yaml grants them; see `openforge doctor --backend kubernetes`)"
        )

    async def _oom_killed(self) -> bool:
        """Whether the container's memory cgroup OOM-killed something since the last look. The Pod's
        status cannot say: its main process (the idle placeholder) lives on when the kernel kills a
        command run through exec, so the cgroup's own counter is read, from inside the container."""
        output = base.Output(4096)
        try:
            code = await self._raw(["sh", "-c", _OOM_KILLS], None, output, 30)
        except SandboxError:
            return False
        found = re.search(rb"^oom_kill (\d+)$", output.stdout_bytes(), re.M)
        if code != 0 or not found:
            return False
        kills = int(found.group(1))
        new, self._oom_kills = kills > self._oom_kills, max(kills, self._oom_kills)
        return new

    async def _blame(
        self, code: int, lost: container.StreamLost | None, before: base.Counters | None
    ) -> str | None:
        """Who killed a command that nothing here killed. The rollout (its memory, the Pod's deadline):
        a result. The cluster (an eviction, a node lost, a deletion): SandboxStartError, retried."""
        if code != 128 + 9:
            return None
        session = self._session
        if session is None:  # stopped meanwhile: the Pod is gone with its session
            return "stopped"
        pod = await self._read(session)
        state, why = assess(pod) if pod is not None else (PodState.INFRA, f"pod {self.pod} is gone")
        if state is PodState.OOM:
            return "oom"
        if state is PodState.DEADLINE:
            return "wall-time"
        if self._state is not base.State.RUNNING:
            return "stopped"
        if state is PodState.INFRA or lost is not None:
            raise SandboxStartError(f"sandbox {self.name}: {why}; {lost or 'command killed'}")
        return "oom" if await self._oom_killed() else None
