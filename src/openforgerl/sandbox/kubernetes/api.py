"""The Kubernetes API as the backend uses it: calls retried on what is transient, creations spaced,
credentials loaded, permissions asked of the API server, and the session a backend holds while it has
sandboxes (the clients, the cap on Pods in flight, the run's parent and its heartbeat)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.stream import WsApiClient

from openforgerl.sandbox.base import SandboxError, SandboxStartError, SandboxUnavailable
from openforgerl.sandbox.kubernetes.manifests import KubernetesConfig, parent_manifest
from openforgerl.sandbox.kubernetes.streams import EXEC_PROTOCOLS

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a Pod's service account must be allowed in its namespace: (verb, resource, subresource).
PERMISSIONS = [
    *((verb, "pods", "") for verb in ("create", "get", "list", "watch", "delete")),
    # The WebSocket upgrade is a GET; clusters since 1.31 also check create on it.
    ("create", "pods", "exec"),
    ("get", "pods", "exec"),
    *((verb, "configmaps", "") for verb in ("create", "get", "list", "patch", "delete")),
]


def _retry_after(exc: ApiException) -> float | None:
    value = exc.headers.get("Retry-After") if exc.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def unavailable(what: str, exc: ApiException) -> SandboxUnavailable:
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    try:
        detail = json.loads(body or "{}").get("message", body)
    except ValueError:
        detail = body
    hint = " (see `openforge doctor --backend kubernetes`)" if exc.status == 403 else ""
    return SandboxUnavailable(f"{what}: {exc.status} {exc.reason}: {detail}{hint}")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status == 429 or (exc.status or 0) >= 500
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return exc.status == 429 or exc.status >= 500
    return isinstance(exc, aiohttp.ClientError | TimeoutError | ConnectionError)


async def retrying(
    call: Callable[[], Awaitable[T]], what: str, attempts: int, base_s: float = 0.25, cap_s: float = 15.0
) -> T:
    """`call`, retried on 429, 5xx and lost connections with capped, jittered exponential backoff (or the
    server's Retry-After). Past the attempts: SandboxStartError. Other API errors go to the caller."""
    for attempt in range(attempts):
        try:
            return await call()
        except Exception as exc:
            if not _is_transient(exc):
                raise
            if attempt + 1 == attempts:
                raise SandboxStartError(f"{what}: the API server kept failing: {exc!s:.300}") from exc
            wait = _retry_after(exc) if isinstance(exc, ApiException) else None
            if wait is None:
                wait = min(cap_s, base_s * 2**attempt) * random.uniform(0.5, 1.0)
            log.info("%s: %s; retrying in %.1f s", what, str(exc).splitlines()[0], wait)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


class _RateLimiter:
    """Spaces calls at least 1/rate apart (creation bursts are what API servers throttle)."""

    def __init__(self, per_s: float) -> None:
        self._interval = 1.0 / per_s
        self._next = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        at = max(now, self._next)
        self._next = at + self._interval
        await asyncio.sleep(at - now)


async def load_client_config(kubeconfig: str | None, context: str | None) -> client.Configuration:
    conf = client.Configuration()
    try:
        if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            await config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=conf, persist_config=False
            )
        else:
            config.load_incluster_config(client_configuration=conf)
    except (ConfigException, OSError, TypeError) as e:
        raise SandboxUnavailable(f"no Kubernetes credentials ({kubeconfig or '$KUBECONFIG'}): {e}") from e
    return conf


async def denied_permissions(
    api: client.ApiClient, namespace: str, wanted: Sequence[tuple[str, str, str]]
) -> list[str]:
    """Of `wanted` (verb, resource, subresource), what the caller may not do in `namespace`, as
    "verb resource/sub", asked of the API server itself (SelfSubjectAccessReview)."""
    denied = []
    for verb, resource, sub in wanted:
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "namespace": namespace,
                    "verb": verb,
                    "resource": resource,
                    "subresource": sub,
                }
            },
        }
        answer = await client.AuthorizationV1Api(api).create_self_subject_access_review(cast(Any, review))
        if not answer.status.allowed:
            denied.append(f"{verb} {resource}{'/' + sub if sub else ''}")
    return denied


class Session:
    """What a backend holds while it has sandboxes, on one event loop: the clients, the cap on Pods in
    flight, the creation rate, the run's parent and its heartbeat."""

    def __init__(self, cfg: KubernetesConfig) -> None:
        self.cfg = cfg
        self.pods = asyncio.Semaphore(cfg.max_pods)
        self.limiter = _RateLimiter(cfg.creates_per_s)
        self.api: client.ApiClient | None = None
        self.ws: WsApiClient | None = None
        self._parent_uid: str | None = None
        self._parent_lock = asyncio.Lock()
        self._heartbeat: asyncio.Task[None] | None = None

    async def open(self) -> None:
        conf = await load_client_config(self.cfg.kubeconfig, self.cfg.context)
        # Each exec holds a connection for as long as its command runs.
        conf.connection_pool_maxsize = self.cfg.max_pods * 2 + 8
        self.api = client.ApiClient(conf)
        self.ws = WsApiClient(conf)
        self.ws.set_default_header("sec-websocket-protocol", EXEC_PROTOCOLS)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def exec_api(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.ws)

    def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        return retrying(fn, what, self.cfg.api_attempts)

    async def parent_uid(self) -> str:
        """The run's parent's uid, made on first use; the heartbeat keeps it from `openforge gc`."""
        async with self._parent_lock:
            if self._parent_uid is None:
                self._parent_uid = await self._touch_parent()
                self._heartbeat = asyncio.create_task(self._beat())
            return self._parent_uid

    async def _touch_parent(self) -> str:
        cfg = self.cfg
        body = parent_manifest(cfg)
        name = body["metadata"]["name"]
        patch = {"metadata": {"annotations": body["metadata"]["annotations"]}}
        try:
            made = await self.call(
                f"patch {name}", lambda: self.core.patch_namespaced_config_map(name, cfg.namespace, patch)
            )
        except ApiException as e:
            if e.status != 404:
                raise unavailable(f"cannot update the run's parent {name}", e) from e
            try:
                made = await self.call(
                    f"create {name}",
                    lambda: self.core.create_namespaced_config_map(cfg.namespace, cast(Any, body)),
                )
            except ApiException as e2:
                raise unavailable(f"cannot create the run's parent {name}", e2) from e2
        return str(made.metadata.uid)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                uid = await self._touch_parent()
            except SandboxError as e:
                log.warning("run %s: heartbeat failed: %s", self.cfg.run_id, e)
                continue
            if uid != self._parent_uid:
                # Deleted meanwhile (with its Pods, by the garbage collector): new Pods get the new one.
                log.warning("run %s: its parent was deleted and made anew", self.cfg.run_id)
                self._parent_uid = uid

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for api in (self.api, self.ws):
            if api is not None:
                await api.close()
