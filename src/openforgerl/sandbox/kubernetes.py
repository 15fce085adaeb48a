"""The Kubernetes backend: a Pod per rollout, its commands and files through the API server's exec API.

Why exec and not a server inside the Pod: the runner then needs nothing but the API server (it runs
wherever kubectl works, in or out of the cluster); rollout Pods accept no ingress at all (the
NetworkPolicy in deploy/kubernetes lets them reach the gateway and nothing else, or with network
"host", for tasks on live web sites, the gateway and public addresses); RBAC on `pods/exec`
is the only credential; and any image with a POSIX shell works, with nothing of ours installed in it.
The price: every command streams through the API server and the kubelet, so the number of Pods in
flight is capped, and a broken stream loses its command (an infrastructure failure: retried).
container.py's wrapper makes up for what exec lacks (a kill at the wall time, stdin's end).

A Pod: the task's image running an idle placeholder as uid 1000 with a read-only root, emptyDirs for
the work dir, HOME and /tmp, no service account token, no capabilities, requests equal to limits
(the Guaranteed class), `activeDeadlineSeconds` as the backstop for every other clean-up, labels for
the run and the rollout, and an owner reference to the run's parent (a ConfigMap per run), so that
deleting the parent deletes the run's Pods. A running runner touches its parent's heartbeat annotation;
`openforge gc` deletes the parents (and the Pods) of runs whose heartbeat stopped.

The gateway is reached at `KubernetesConfig.gateway_url` (its Service, as Pods see it); env values
that name it as the host does are rewritten to that. The rollout's key arrives with the harness's own
exec env, so it never sits in the Pod object for anyone who may read Pods.

Failures (see `assess`): what the cluster did (image pull errors, evictions, preemptions, a node lost,
a Pod deleted, a Pod that never became ready, API errors past the retries) raises SandboxStartError,
which the runner retries; what the rollout did (an OOM kill, the Pod's deadline) is the exec's result,
a policy outcome. An OOM kill of a command run through exec leaves the container running, so the Pod's
status never says it: the container's memory cgroup's own count does (`_oom_killed`). A missing
permission or an invalid configuration raises SandboxUnavailable, naming what is missing.

A spec's own work dir (Harbor's /app) and extra dirs are emptyDirs like /workspace: what the image
holds at that path is hidden (the Docker backend keeps it), so such a task's files must come as its
workspace. A spec whose image is built from a Dockerfile (`SandboxSpec.build`) is refused: a cluster
pulls images, it does not build them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.stream import WsApiClient
from pydantic import BaseModel, ConfigDict, Field

from openforgerl.sandbox import base, container
from openforgerl.sandbox.base import (
    BackendCheck,
    SandboxError,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
    rewrite_gateway,
)
from openforgerl.sandbox.container import MANAGED_BY, RUN, SANDBOX

log = logging.getLogger(__name__)

T = TypeVar("T")

COMPONENT = "app.kubernetes.io/component"
ROLLOUT = "openforgerl.dev/rollout"
NETWORK = "openforgerl.dev/network"
HEARTBEAT = "openforgerl.dev/heartbeat"
OURS = f"{MANAGED_BY}=openforgerl"
CONTAINER = "sandbox"
# v5 can close stdin; servers that only know v4 pick it, and the wrapper's counted stdin does without.
EXEC_PROTOCOLS = "v5.channel.k8s.io,v4.channel.k8s.io"
_STDIN, _STDOUT, _STDERR, _STATUS, _CLOSE = 0, 1, 2, 3, 255
_CHUNK = 256 << 10
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# Waiting reasons after which a container will not start by itself.
_FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
}
# What a Pod's service account must be allowed in its namespace: (verb, resource, subresource).
PERMISSIONS = [
    *((verb, "pods", "") for verb in ("create", "get", "list", "watch", "delete")),
    # The WebSocket upgrade is a GET; clusters since 1.31 also check create on it.
    ("create", "pods", "exec"),
    ("get", "pods", "exec"),
    *((verb, "configmaps", "") for verb in ("create", "get", "list", "patch", "delete")),
]


class KubernetesConfig(BaseModel):
    """Where and how rollout Pods run (from a YAML file: `KubernetesConfig.model_validate(mapping)`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=1)
    image: str = Field(min_length=1, description="The task image; the harness is installed in it.")
    namespace: str = "default"
    # The gateway as Pods reach it (its Service); None when Pods reach it at the runner's own URL.
    gateway_url: str | None = None
    # Where a gateway embedded in the run (eval, train) listens instead of loopback: an address of the
    # runner's machine that Pods route to (a one-node cluster's bridge), with gateway_url left unset.
    gateway_host: str | None = None
    kubeconfig: str | None = None  # None: $KUBECONFIG or ~/.kube/config, or the in-cluster account
    context: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    runtime_class: str | None = None  # e.g. gvisor or kata, for a kernel boundary per Pod
    service_account: str | None = None
    image_pull_secrets: list[str] = Field(default_factory=list)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # A volume of installed harnesses (a ReadOnlyMany claim filled by `openforge harness install`),
    # mounted read-only rather than copied by an init container: a copy per Pod would move gigabytes.
    harness_claim: str | None = None
    harness_path: str = "/opt/openforgerl/harnesses"
    ephemeral_storage: str | None = "4Gi"  # requests = limits, and each emptyDir's size limit
    # CPU requests as this share of the limit. 1: requests = limits, the Guaranteed class, a node takes
    # as many Pods as it has cores. Below 1 (a laptop's one-node cluster): Burstable Pods, packed by
    # their requests and each still capped by its limit (memory requests stay equal to the limits).
    cpu_request_fraction: float = Field(default=1.0, gt=0, le=1)
    max_pods: int = Field(default=64, ge=1)  # Pods in flight at once
    creates_per_s: float = Field(default=5.0, gt=0)
    start_timeout_s: float = Field(default=600.0, gt=0)
    api_attempts: int = Field(default=6, ge=1)  # per API call, on 429, 5xx and lost connections
    deadline_s: int | None = Field(default=None, ge=1)  # activeDeadlineSeconds; default from the limits
    heartbeat_s: float = Field(default=30.0, gt=0)
    # While a command runs, its Pod is read this often: a Pod that ended (its deadline, an eviction, a
    # deletion) ends the command, whose exec stream a real kubelet may leave open.
    pod_check_s: float = Field(default=10.0, gt=0)


# -- names and manifests --------------------------------------------------------------------------


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def dns_name(prefix: str, readable: str, *salt: str) -> str:
    """A DNS-1123 label (at most 63 characters) that reads like `readable`, unique through a digest."""
    base = re.sub(r"[^a-z0-9]+", "-", readable.lower()).strip("-")[: 62 - len(prefix) - 9].strip("-")
    return f"{prefix}-{base}-{_digest(readable, *salt)}" if base else f"{prefix}-{_digest(readable, *salt)}"


def pod_name(cfg: KubernetesConfig, name: str) -> str:
    return dns_name("of", name, cfg.run_id)


def label_value(value: str) -> str:
    """`value` as a label value (63 characters of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    if len(value) <= 63 and _LABEL_VALUE.fullmatch(value):
        return value
    head = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:54].strip("-_.")
    return f"{head}-{_digest(value)}" if head else _digest(value)


def quantity_cpu(cpus: float) -> str:
    return f"{max(1, round(cpus * 1000))}m"


def quantity_memory(n: int) -> str:
    return f"{n >> 20}Mi" if n % (1 << 20) == 0 else str(n)


def parent_manifest(cfg: KubernetesConfig, now: float | None = None) -> dict[str, Any]:
    """The run's parent: every Pod of the run is its dependent, and its heartbeat says the run lives."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": dns_name("openforge-run", cfg.run_id),
            "namespace": cfg.namespace,
            "labels": {MANAGED_BY: "openforgerl", COMPONENT: "run", RUN: label_value(cfg.run_id)},
            "annotations": {HEARTBEAT: str(int(now if now is not None else time.time())), RUN: cfg.run_id},
        },
        "data": {"run_id": cfg.run_id},
    }


def pod_deadline(cfg: KubernetesConfig, spec: SandboxSpec) -> int:
    """A Pod lives at most three of its longest exec (set-up, harness and verifier), or a day."""
    if cfg.deadline_s:
        return cfg.deadline_s
    wall = spec.limits.wall_time_s
    return math.ceil(3 * wall) + 300 if wall else 86400


def pod_manifest(
    cfg: KubernetesConfig, spec: SandboxSpec, name: str, parent_uid: str | None = None
) -> dict[str, Any]:
    """The Pod of sandbox `name` (a name the runner made: `<run id>-<rollout id>`)."""
    limits = spec.limits
    resources: dict[str, str] = {}
    requests: dict[str, str] = {}
    if limits.cpus is not None:
        resources["cpu"] = quantity_cpu(limits.cpus)
        requests["cpu"] = quantity_cpu(limits.cpus * cfg.cpu_request_fraction)
    if limits.memory_bytes is not None:
        resources["memory"] = quantity_memory(limits.memory_bytes)
    if cfg.ephemeral_storage:
        resources["ephemeral-storage"] = cfg.ephemeral_storage
    rollout = name.removeprefix(f"{cfg.run_id}-")
    labels = {
        MANAGED_BY: "openforgerl",
        COMPONENT: "rollout",
        RUN: label_value(cfg.run_id),
        ROLLOUT: label_value(rollout),
        NETWORK: spec.network,
        **{f"openforgerl.dev/{k}": label_value(v) for k, v in spec.labels.items()},
    }
    metadata: dict[str, Any] = {
        "name": pod_name(cfg, name),
        "namespace": cfg.namespace,
        "labels": labels,
        "annotations": {SANDBOX: name, RUN: cfg.run_id},
    }
    if parent_uid:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": dns_name("openforge-run", cfg.run_id),
                "uid": parent_uid,
            }
        ]
    inside = (cfg.gateway_url or spec.gateway_url) if spec.network != "none" else None
    env = container.base_env(rewrite_gateway(spec.env, spec.gateway_url, inside), inside)
    size = {"sizeLimit": cfg.ephemeral_storage} if cfg.ephemeral_storage else {}
    workdir, home, tmp, *extra = container.sandbox_roots(spec)
    volumes: list[dict[str, Any]] = [
        {"name": "workspace", "emptyDir": dict(size)},
        {"name": "home", "emptyDir": dict(size)},
        {"name": "tmp", "emptyDir": dict(size)},
        *({"name": f"extra-{i}", "emptyDir": dict(size)} for i in range(len(extra))),
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "workspace", "mountPath": workdir},
        {"name": "home", "mountPath": home},
        {"name": "tmp", "mountPath": tmp},
        *({"name": f"extra-{i}", "mountPath": path} for i, path in enumerate(extra)),
    ]
    if cfg.harness_claim:
        volumes.append(
            {"name": "harnesses", "persistentVolumeClaim": {"claimName": cfg.harness_claim, "readOnly": True}}
        )
        mounts.append({"name": "harnesses", "mountPath": cfg.harness_path, "readOnly": True})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": pod_deadline(cfg, spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The pause container becomes init: it reaps what the execs leave orphaned.
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": 5,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": container.UID,
            "runAsGroup": container.UID,
            "fsGroup": container.UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": CONTAINER,
                "image": spec.image or cfg.image,
                "imagePullPolicy": cfg.image_pull_policy,
                "command": container.IDLE,
                "workingDir": workdir,
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "resources": {"requests": resources | requests, "limits": dict(resources)},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if cfg.service_account:
        pod_spec["serviceAccountName"] = cfg.service_account
    if cfg.node_selector:
        pod_spec["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in cfg.tolerations]
    if cfg.runtime_class:
        pod_spec["runtimeClassName"] = cfg.runtime_class
    if cfg.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in cfg.image_pull_secrets]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# -- what a Pod's status says ---------------------------------------------------------------------


class PodState(enum.Enum):
    PENDING = "pending"  # not ready yet, and nothing says it will not be
    READY = "ready"
    INFRA = "infra"  # the cluster failed it: the runner retries the rollout
    OOM = "oom"  # the rollout used more memory than its limit: a policy outcome
    DEADLINE = "deadline"  # the rollout outlived activeDeadlineSeconds: a policy outcome (timeout)


def assess(pod: Mapping[str, Any]) -> tuple[PodState, str]:
    """A Pod's state (camelCase JSON, as the API sends it), and why, in words."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    phase, reason, message = status.get("phase"), status.get("reason"), status.get("message") or ""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return PodState.INFRA, f"pod {name} is being deleted"
    main: Mapping[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == CONTAINER), {}
    )
    state = main.get("state") or {}
    ended = state.get("terminated") or (main.get("lastState") or {}).get("terminated") or {}
    if ended.get("reason") == "OOMKilled":
        return PodState.OOM, f"pod {name}: its container was OOM-killed"
    if phase in ("Failed", "Succeeded"):
        if reason == "DeadlineExceeded":
            return PodState.DEADLINE, f"pod {name} ran past its activeDeadlineSeconds"
        why = reason or ended.get("reason") or "its container ended"
        return PodState.INFRA, f"pod {name} {phase.lower()}: {why} {message}".rstrip()
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget")
    if disruption and disruption.get("status") == "True":
        why = f"{disruption.get('reason', '')} {disruption.get('message', '')}".strip()
        return PodState.INFRA, f"pod {name} disrupted: {why}"
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in _FATAL_WAITING:
        return PodState.INFRA, f"pod {name}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    ready = conditions.get("Ready")
    if phase == "Running" and ready and ready.get("status") == "True":
        return PodState.READY, f"pod {name} is ready"
    scheduled = conditions.get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return PodState.PENDING, f"pod {name} unschedulable: {scheduled.get('message', '')}"
    return PodState.PENDING, f"pod {name} {phase or 'pending'}: {waiting.get('reason') or 'starting'}"


# -- the API, with retries ------------------------------------------------------------------------


def _retry_after(exc: ApiException) -> float | None:
    value = exc.headers.get("Retry-After") if exc.headers else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _unavailable(what: str, exc: ApiException) -> SandboxUnavailable:
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


class _Session:
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
                raise _unavailable(f"cannot update the run's parent {name}", e) from e
            try:
                made = await self.call(
                    f"create {name}",
                    lambda: self.core.create_namespaced_config_map(cfg.namespace, cast(Any, body)),
                )
            except ApiException as e2:
                raise _unavailable(f"cannot create the run's parent {name}", e2) from e2
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


class KubernetesBackend:
    """Sandboxes as Pods in one namespace: see the module's doc. One backend serves one run."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesConfig) -> None:
        self.cfg = cfg
        self._session: _Session | None = None
        self._opening: asyncio.Future[None] | None = None
        self._users = 0

    async def _acquire(self) -> _Session:
        """The session of this event loop, opened by the first sandbox and closed with the last."""
        self._users += 1
        try:
            if self._session is None:
                self._session = _Session(self.cfg)
                self._opening = asyncio.ensure_future(self._session.open())
            assert self._opening is not None
            await asyncio.shield(self._opening)
            return self._session
        except BaseException:
            await self._release()
            raise

    async def _release(self) -> None:
        self._users -= 1
        if self._users == 0 and self._session is not None:
            session, self._session, self._opening = self._session, None, None
            await session.close()

    @property
    def isolation(self) -> str:
        return f"pod ({self.cfg.runtime_class})" if self.cfg.runtime_class else "pod"

    def create(self, spec: SandboxSpec, name: str) -> KubernetesSandbox:
        if spec.network != "none" and not (self.cfg.gateway_url or spec.gateway_url):
            raise ValueError(f"network={spec.network!r} needs the gateway's URL as Pods reach it")
        if spec.build is not None:
            raise SandboxUnavailable(
                f"sandbox {name}: its image {spec.image} is made from {spec.build}/Dockerfile, which a "
                "cluster cannot build: build and push it, and name it as the task's image "
                "(Harbor: [environment] docker_image)"
            )
        if spec.ro_binds:
            # A Pod sees its image, not this host: the harness must be in the image (or the cache volume).
            log.debug("sandbox %s: ro_binds are not mounted into Pods", name)
        return KubernetesSandbox(self, spec, name)

    def check(self) -> BackendCheck:
        """Access, version, permissions, runtime class and NetworkPolicy, checked against the cluster."""
        # A fresh loop in a thread: check() is synchronous, and may be called from inside a loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._check()).result()

    async def _check(self) -> BackendCheck:
        cfg = self.cfg
        available: dict[str, str] = {}
        missing: dict[str, str] = {}
        isolation = self.isolation
        try:
            conf = await load_client_config(cfg.kubeconfig, cfg.context)
        except SandboxUnavailable as e:
            missing["credentials"] = str(e)
            return BackendCheck(self.name, isolation, "cgroup", available, missing)
        async with client.ApiClient(conf) as api:
            try:
                version = await retrying(lambda: client.VersionApi(api).get_code(), "version", 2)
                available["api"] = f"{conf.host} (Kubernetes {version.git_version})"
            except (ApiException, SandboxError, aiohttp.ClientError) as e:
                missing["api"] = f"cannot reach {conf.host}: {str(e).splitlines()[0]}"
                return BackendCheck(self.name, isolation, "cgroup", available, missing)
            denied = await denied_permissions(api, cfg.namespace, PERMISSIONS)
            if denied:
                missing["permissions"] = (
                    f"not allowed in namespace {cfg.namespace}: {', '.join(denied)} "
                    "(deploy/kubernetes/rbac.yaml grants them)"
                )
            else:
                available["permissions"] = f"pods, pods/exec and configmaps in namespace {cfg.namespace}"
            if cfg.runtime_class:
                try:
                    await client.NodeV1Api(api).read_runtime_class(cfg.runtime_class)
                    available["runtime class"] = cfg.runtime_class
                except ApiException as e:
                    key = "runtime class" if e.status == 404 else "runtime class (unverified)"
                    missing[key] = f"{cfg.runtime_class}: {e.status} {e.reason}"
            try:
                policies = await client.NetworkingV1Api(api).list_namespaced_network_policy(
                    cfg.namespace, label_selector="app.kubernetes.io/part-of=openforgerl"
                )
                names = [p.metadata.name for p in policies.items]
                if names:
                    available["network policy"] = ", ".join(names)
                else:
                    missing["network policy"] = (
                        f"none in namespace {cfg.namespace}: rollout Pods can reach anything "
                        "(kubectl apply -f deploy/kubernetes/networkpolicy.yaml)"
                    )
            except ApiException as e:
                missing["network policy (unverified)"] = f"cannot list NetworkPolicies: {e.status} {e.reason}"
        return BackendCheck(self.name, isolation, "cgroup", available, missing)


class KubernetesSandbox(container.ContainerSandbox):
    """A sandbox of `KubernetesBackend`: see the module's doc. Its network "gateway" (and "host" short
    of the cluster's private addresses) holds only where deploy/kubernetes' NetworkPolicies are applied
    (doctor checks it)."""

    def __init__(self, backend: KubernetesBackend, spec: SandboxSpec, name: str) -> None:
        super().__init__(
            spec, name, image=backend.cfg.image, isolation=backend.isolation, backend_name=backend.name
        )
        self.backend = backend
        self.pod = pod_name(backend.cfg, name)
        self._session: _Session | None = None
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

    async def _create(self, session: _Session) -> None:
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
                raise _unavailable(f"cannot create pod {self.pod}", e) from e
            # An earlier try whose answer was lost got through: the name is this sandbox's alone.
            log.info("pod %s: created by an earlier try", self.pod)
        self._created = True

    async def _read(self, session: _Session) -> dict[str, Any] | None:
        core = session.core
        try:
            pod = await session.call(
                f"read pod {self.pod}", lambda: core.read_namespaced_pod(self.pod, self._cfg.namespace)
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise _unavailable(f"cannot read pod {self.pod}", e) from e
        # The API's own JSON (camelCase), which `assess` reads.
        assert session.api is not None
        return cast(dict[str, Any], session.api.sanitize_for_serialization(pod))

    async def _until_ready(self, session: _Session) -> None:
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

    async def _last_warning(self, session: _Session) -> str | None:
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

        async def pump() -> None:
            if stdin is not None:
                for chunk in container.stdin_chunks(stdin, _CHUNK):
                    await ws.send_bytes(bytes([_STDIN]) + chunk)
                await ws.send_bytes(bytes([_CLOSE, _STDIN]))
            async for msg in ws:
                if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    break
                data = msg.data if isinstance(msg.data, bytes) else msg.data.encode()
                if not data:
                    continue
                if data[0] == _STDOUT:
                    output.stdout.feed(data[1:])
                elif data[0] == _STDERR:
                    output.stderr.feed(data[1:])
                elif data[0] == _STATUS:
                    status.extend(data[1:])

        reading = asyncio.ensure_future(pump())
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
        return _exit_code(bytes(status))

    async def _until_pod_ends(self, session: _Session) -> str:
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

    async def _exec_forbidden(self, session: _Session) -> str:
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


def _exit_code(status: bytes) -> int:
    """The exit code in the exec's status (channel 3): Success, or NonZeroExitCode with an ExitCode."""
    try:
        doc = json.loads(status)
    except ValueError as e:
        raise container.StreamLost(f"unreadable exec status {status[:200]!r}") from e
    if doc.get("status") == "Success":
        return 0
    for cause in (doc.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise container.StreamLost(f"the command did not run: {doc.get('message', doc)}")


# The memory cgroup's OOM kill count, as the container sees its own cgroup (v1, else v2).
_OOM_KILLS = "cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null || cat /sys/fs/cgroup/memory.events"


# -- garbage collection ---------------------------------------------------------------------------


async def collect_garbage(
    namespace: str,
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
    run: str | None = None,
    older_than_s: float = 600.0,
    dry_run: bool = False,
) -> list[container.Garbage]:
    """Deletes what crashed runs left: the parents whose heartbeat is older than `older_than_s` (or the
    parent of `run`), their Pods, and Pods with no parent at all that are that old."""
    conf = await load_client_config(kubeconfig, context)
    now = time.time()
    found: list[container.Garbage] = []
    async with client.ApiClient(conf) as api:
        core = client.CoreV1Api(api)
        parents = (
            await retrying(
                lambda: core.list_namespaced_config_map(namespace, label_selector=f"{OURS},{COMPONENT}=run"),
                "list run parents",
                6,
            )
        ).items
        pods = (
            await retrying(
                lambda: core.list_namespaced_pod(namespace, label_selector=f"{OURS},{COMPONENT}=rollout"),
                "list rollout pods",
                6,
            )
        ).items
        live: set[str] = set()
        for parent in parents:
            labels = parent.metadata.labels or {}
            notes = parent.metadata.annotations or {}
            beat = float(notes.get(HEARTBEAT, "0") or 0)
            stale = labels.get(RUN) == label_value(run) if run else now - beat > older_than_s
            if stale:
                found.append(
                    container.Garbage("configmap", parent.metadata.name, notes.get(RUN, labels.get(RUN, "")))
                )
            else:
                live.add(labels.get(RUN, ""))
        dead_runs = {label_value(g.run) for g in found}
        for pod in pods:
            label = (pod.metadata.labels or {}).get(RUN, "")
            created = pod.metadata.creation_timestamp
            age = now - created.timestamp() if created else math.inf
            if label in dead_runs or (not run and label not in live and age > older_than_s):
                found.append(
                    container.Garbage(
                        "pod", pod.metadata.name, (pod.metadata.annotations or {}).get(RUN, label)
                    )
                )
        if not dry_run:
            for item in found:
                delete = (
                    core.delete_namespaced_pod if item.kind == "pod" else core.delete_namespaced_config_map
                )
                call = functools.partial(delete, item.name, namespace, grace_period_seconds=0)
                try:
                    await retrying(call, f"delete {item.kind} {item.name}", 6)
                except ApiException as e:
                    if e.status != 404:
                        raise _unavailable(f"cannot delete {item.kind} {item.name}", e) from e
    return found
