"""A FAKE Kubernetes API server paired with a FAKE kubelet, for testing the Kubernetes backend (tests only).

Neither is Kubernetes. The fake API server keeps objects in memory and answers only what the backend,
`openforge doctor` and `openforge gc` use, in the API's JSON shapes: pods (create, read, list and watch
with label and field selectors from a resourceVersion, delete, exec over WebSocket v4/v5.channel.k8s.io),
configmaps (create, read, list, patch, delete, with the garbage collector's cascade to dependents named
by ownerReferences), SelfSubjectAccessReviews, RuntimeClasses, NetworkPolicies and /version. It checks
a bearer token. `faults` makes chosen requests fail (429, 500, ...) to test retries.

The fake kubelet runs each Pod as a local sandbox (`LocalBackend`): the Pod's image decides what
happens (`images`: "run" starts it, "hang" leaves it ContainerCreating forever, "crash" fails it; an
image it does not know fails to pull). The Pod's env, limits and activeDeadlineSeconds are honoured:
its network is the URL in OPENFORGE_GATEWAY_URL and nothing else (what the NetworkPolicy does on a real
cluster); an exec that the local sandbox reports OOM-killed ends the whole container as OOMKilled (what
memory.oom.group does on cgroup v2 nodes); `evict` evicts a Pod. Exec output is the local sandbox's
text, so binary output is not byte-exact here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from openforgerl.gateway.server import free_port, uvicorn_in_thread
from openforgerl.sandbox.base import Limits, SandboxError, SandboxSpec
from openforgerl.sandbox.local import LocalBackend, LocalSandbox

Behaviour = Literal["run", "hang", "crash"]
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _memory(q: str) -> int:
    for unit, factor in _UNITS.items():
        if q.endswith(unit):
            return int(float(q[: -len(unit)]) * factor)
    return int(q)


def _cpu(q: str) -> float:
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _true(value: str | None) -> bool:
    """A boolean query parameter, as Go's strconv.ParseBool reads it."""
    return value in ("1", "t", "T", "true", "True", "TRUE")


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    return JSONResponse(body | {"reason": reason, "code": code}, status_code=code)


def _selected(obj: Mapping[str, Any], labels: str | None, fields: str | None) -> bool:
    have = obj["metadata"].get("labels") or {}
    for term in filter(None, (labels or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if have.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if have.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in have:
                return False
        elif term not in have:
            return False
    for term in filter(None, (fields or "").split(",")):
        k, v = term.split("=", 1)
        if k == "metadata.name" and obj["metadata"]["name"] != v:
            return False
        if k == "metadata.namespace" and obj["metadata"].get("namespace") != v:
            return False
    return True


@dataclass
class Fault:
    """Answer the next `count` requests whose method and path match with `status`."""

    method: str
    path_contains: str
    status: int
    count: int = 1
    retry_after: float | None = None


@dataclass
class _Event:
    rv: int
    kind: str
    type: str
    obj: dict[str, Any]


@dataclass
class FakeCluster:
    """The fake API server's store and the fake kubelet (see the module's doc)."""

    images: Mapping[str, Behaviour]
    ro_binds: Sequence[str] = ()
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    denied: set[tuple[str, str, str]] = field(default_factory=set)  # (verb, resource, subresource)
    runtime_classes: set[str] = field(default_factory=set)
    # As a real kubelet (1.20, dockershim) does: a Pod killed under a command (its deadline, an
    # eviction) leaves that command's exec stream open until the client goes away.
    hold_killed_streams: bool = False
    # Checks every created object, as admission would: an error message rejects it with 422.
    admit: Callable[[dict[str, Any]], str | None] | None = None
    local: LocalBackend = field(default_factory=LocalBackend)
    faults: list[Fault] = field(default_factory=list)
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    created: list[dict[str, Any]] = field(default_factory=list)
    sandboxes: dict[str, LocalSandbox] = field(default_factory=dict)
    peak: int = 0  # the most Pods that ran at once
    url: str = ""
    loop: asyncio.AbstractEventLoop | None = None
    _events: list[_Event] = field(default_factory=list)
    _rv: int = 0
    _changed: asyncio.Condition | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    # -- the store ---------------------------------------------------------------------------------

    def _put(self, kind: str, obj: dict[str, Any], type_: str) -> dict[str, Any]:
        self._rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        key = (kind, meta.get("namespace", ""), meta["name"])
        if type_ == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self._events.append(_Event(self._rv, kind, type_, json.loads(json.dumps(obj))))
        assert self._changed is not None
        self._changed.notify_all()
        return obj

    async def _change(self, kind: str, obj: dict[str, Any], type_: str = "MODIFIED") -> dict[str, Any]:
        assert self._changed is not None
        async with self._changed:
            return self._put(kind, obj, type_)

    def stored(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [o for (k, ns, _), o in self.objects.items() if k == kind and namespace in (None, ns)]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def call(self, coro: Any) -> Any:
        """Runs a coroutine on the cluster's loop from another thread (tests)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    # -- the fake kubelet --------------------------------------------------------------------------

    def _pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get(("pods", namespace, name))

    async def _set_status(self, pod: dict[str, Any], **status: Any) -> None:
        if self._pod(pod["metadata"]["namespace"], pod["metadata"]["name"]) is not pod:
            return  # deleted meanwhile
        pod["status"] = {**pod.get("status", {}), **status}
        await self._change("pods", pod)

    @staticmethod
    def _container(state: dict[str, Any], ready: bool = False) -> list[dict[str, Any]]:
        return [
            {"name": "sandbox", "ready": ready, "restartCount": 0, "image": "", "imageID": "", "state": state}
        ]

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        spec = pod["spec"]
        main = spec["containers"][0]
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
        waiting = {"waiting": {"reason": "ContainerCreating"}}
        await self._set_status(pod, conditions=[scheduled], containerStatuses=self._container(waiting))
        behaviour = self.images.get(main["image"])
        if behaviour is None:
            message = f'Back-off pulling image "{main["image"]}"'
            pulling = {"waiting": {"reason": "ImagePullBackOff", "message": message}}
            await self._set_status(pod, containerStatuses=self._container(pulling))
            return
        if behaviour == "hang":
            return
        if behaviour == "crash":
            ended = {"terminated": {"reason": "Error", "exitCode": 1}}
            await self._set_status(pod, phase="Failed", containerStatuses=self._container(ended))
            return
        env = {e["name"]: e["value"] for e in main.get("env", [])}
        limits = main.get("resources", {}).get("limits", {})
        gateway = env.get("OPENFORGE_GATEWAY_URL")
        sandbox = self.local.create(
            SandboxSpec(
                env=env,
                limits=Limits(
                    memory_bytes=_memory(limits["memory"]) if "memory" in limits else None,
                    cpus=_cpu(limits["cpu"]) if "cpu" in limits else None,
                    pids=1024,
                    wall_time_s=None,
                ),
                network="gateway" if gateway else "none",
                gateway_url=gateway,
                ro_binds=self.ro_binds,
            ),
            pod["metadata"]["name"],
        )
        self.sandboxes[pod["metadata"]["name"]] = sandbox
        self.peak = max(self.peak, len(self.sandboxes))
        try:
            await sandbox.start()
        except SandboxError as e:
            ended = {"terminated": {"reason": "StartError", "message": str(e), "exitCode": 128}}
            await self._set_status(pod, phase="Failed", containerStatuses=self._container(ended))
            return
        ready = {"type": "Ready", "status": "True", "lastTransitionTime": _now()}
        running = {"running": {"startedAt": _now()}}
        await self._set_status(
            pod,
            phase="Running",
            startTime=_now(),
            conditions=[scheduled, ready],
            containerStatuses=self._container(running, ready=True),
        )
        if spec.get("activeDeadlineSeconds"):
            await asyncio.sleep(spec["activeDeadlineSeconds"])
            await self._kill(pod, "DeadlineExceeded", "Pod was active on the node longer than specified")

    async def _kill(self, pod: dict[str, Any], reason: str, message: str, **status: Any) -> None:
        """Fails a Pod: its status first (what a client that sees its exec die reads), then its sandbox."""
        await self._set_status(pod, phase="Failed", reason=reason, message=message, **status)
        sandbox = self.sandboxes.pop(pod["metadata"]["name"], None)
        if sandbox is not None:
            await sandbox.stop()

    def evict(self, namespace: str, name: str) -> None:
        """Evicts a Pod, as node pressure or the eviction API would (call from another thread)."""

        async def go() -> None:
            pod = self._pod(namespace, name)
            assert pod is not None, name
            disruption = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
            conditions = [*pod["status"].get("conditions", []), disruption]
            await self._kill(pod, "Evicted", "The node was low on resource: memory.", conditions=conditions)

        self.call(go())

    async def _delete_pod(self, pod: dict[str, Any]) -> None:
        sandbox = self.sandboxes.pop(pod["metadata"]["name"], None)
        if sandbox is not None:
            await sandbox.stop()
        if self._pod(pod["metadata"]["namespace"], pod["metadata"]["name"]) is pod:
            await self._change("pods", pod, "DELETED")

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sandbox in list(self.sandboxes.values()):
            await sandbox.stop()
        self.sandboxes.clear()

    # -- the fake API server -----------------------------------------------------------------------

    def app(self) -> Starlette:
        ns = "/api/v1/namespaces/{ns}"
        routes = [
            Route("/version", self._version),
            Route("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", self._review, methods=["POST"]),
            Route("/apis/node.k8s.io/v1/runtimeclasses/{name}", self._runtime_class),
            Route("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", self._collection),
            Route(ns + "/{kind:str}", self._collection, methods=["GET", "POST"]),
            Route(ns + "/{kind:str}/{name}", self._object, methods=["GET", "PATCH", "DELETE"]),
            WebSocketRoute(ns + "/pods/{name}/exec", self._exec),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()
        yield

    def add(self, kind: str, namespace: str, obj: dict[str, Any]) -> None:
        """Stores an object as if it had been applied (call from another thread)."""
        self.call(self._create(kind, namespace, json.loads(json.dumps(obj))))

    def _refuse(self, method: str, path: str, headers: Mapping[str, str]) -> Response | None:
        if headers.get("authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        for fault in self.faults:
            if fault.count > 0 and fault.method == method and fault.path_contains in path:
                fault.count -= 1
                response = _status(fault.status, "Injected", f"injected {fault.status}")
                if fault.retry_after is not None:
                    response.headers["Retry-After"] = str(fault.retry_after)
                return response
        return None

    async def _version(self, request: Request) -> Response:
        if refused := self._refuse(request.method, request.url.path, request.headers):
            return refused
        version = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "fake"}
        build = {"gitTreeState": "clean", "buildDate": _now(), "goVersion": "go1.24", "compiler": "gc"}
        return JSONResponse(version | build | {"platform": "linux/amd64"})

    async def _review(self, request: Request) -> Response:
        if refused := self._refuse(request.method, request.url.path, request.headers):
            return refused
        review = await request.json()
        attrs = review["spec"]["resourceAttributes"]
        wanted = (attrs.get("verb", ""), attrs.get("resource", ""), attrs.get("subresource", ""))
        return JSONResponse(review | {"status": {"allowed": wanted not in self.denied}}, status_code=201)

    async def _runtime_class(self, request: Request) -> Response:
        if refused := self._refuse(request.method, request.url.path, request.headers):
            return refused
        name = request.path_params["name"]
        if name not in self.runtime_classes:
            return _status(404, "NotFound", f'runtimeclasses.node.k8s.io "{name}" not found')
        body = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}}
        return JSONResponse(body | {"handler": name})

    async def _collection(self, request: Request) -> Response:
        if refused := self._refuse(request.method, request.url.path, request.headers):
            return refused
        namespace = request.path_params["ns"]
        kind = request.path_params.get("kind", "networkpolicies")
        if kind not in ("pods", "configmaps", "networkpolicies"):
            return _status(404, "NotFound", f"the fake knows no {kind}")
        if request.method == "POST":
            return await self._create(kind, namespace, await request.json())
        q = request.query_params
        labels, fields = q.get("labelSelector"), q.get("fieldSelector")
        if _true(q.get("watch")):
            since = int(q.get("resourceVersion") or 0)
            stream = self._watch(
                kind, namespace, labels, fields, since, float(q.get("timeoutSeconds") or 300)
            )
            return StreamingResponse(stream, media_type="application/json")
        items = [o for o in self.stored(kind, namespace) if _selected(o, labels, fields)]
        list_kind = {"pods": "PodList", "configmaps": "ConfigMapList", "networkpolicies": "NetworkPolicyList"}
        body = {"kind": list_kind[kind], "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}}
        return JSONResponse(body | {"items": items})

    async def _create(self, kind: str, namespace: str, obj: dict[str, Any]) -> Response:
        if self.admit is not None and (error := self.admit(obj)):
            return _status(422, "Invalid", error)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        if (kind, namespace, meta.get("name", "")) in self.objects:
            return _status(409, "AlreadyExists", f'{kind} "{meta.get("name")}" already exists')
        meta |= {"uid": str(uuid.uuid4()), "creationTimestamp": _now()}
        if kind == "pods":
            obj["status"] = {"phase": "Pending"}
        self.created.append(json.loads(json.dumps(obj)))
        await self._change(kind, obj, "ADDED")
        if kind == "pods":
            self._spawn(self._run_pod(obj))
        return JSONResponse(obj, status_code=201)

    async def _watch(
        self, kind: str, namespace: str, labels: str | None, fields: str | None, since: int, timeout_s: float
    ) -> AsyncIterator[bytes]:
        assert self._changed is not None
        deadline = time.monotonic() + timeout_s
        while True:
            for event in [e for e in self._events if e.rv > since]:
                since = event.rv
                if (
                    event.kind == kind
                    and event.obj["metadata"].get("namespace") == namespace
                    and _selected(event.obj, labels, fields)
                ):
                    yield json.dumps({"type": event.type, "object": event.obj}).encode() + b"\n"
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        while self._rv <= since:
                            await self._changed.wait()
            if time.monotonic() >= deadline:
                return

    async def _object(self, request: Request) -> Response:
        if refused := self._refuse(request.method, request.url.path, request.headers):
            return refused
        kind, namespace, name = (request.path_params[k] for k in ("kind", "ns", "name"))
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            return _status(404, "NotFound", f'{kind} "{name}" not found')
        if request.method == "GET":
            return JSONResponse(obj)
        if request.method == "PATCH":
            # A merge patch (what a strategic merge patch of maps amounts to).
            def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
                for k, v in patch.items():
                    if isinstance(v, Mapping) and isinstance(into.get(k), dict):
                        merge(into[k], v)
                    elif v is None:
                        into.pop(k, None)
                    else:
                        into[k] = v

            merge(obj, await request.json())
            return JSONResponse(await self._change(kind, obj))
        if kind == "pods":
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = _now()
                await self._change(kind, obj)
                self._spawn(self._delete_pod(obj))
            return JSONResponse(obj)
        await self._change(kind, obj, "DELETED")
        # The garbage collector: dependents go with their owner.
        uid = obj["metadata"]["uid"]
        for pod in self.stored("pods"):
            if any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences", [])):
                pod["metadata"]["deletionTimestamp"] = _now()
                await self._change("pods", pod)
                self._spawn(self._delete_pod(pod))
        return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})

    async def _exec(self, ws: WebSocket) -> None:
        if refused := self._refuse("GET", ws.url.path, ws.headers):
            await ws.send_denial_response(refused)
            return
        namespace, name = ws.path_params["ns"], ws.path_params["name"]
        sandbox = self.sandboxes.get(name)
        pod = self._pod(namespace, name)
        if pod is None or sandbox is None or pod["status"].get("phase") != "Running":
            await ws.send_denial_response(_status(400, "BadRequest", f"pod {name} has no running container"))
            return
        offered = ws.scope.get("subprotocols", [])
        protocol = next((p for p in ("v5.channel.k8s.io", "v4.channel.k8s.io") if p in offered), None)
        if protocol is None:
            await ws.send_denial_response(_status(400, "BadRequest", "no channel.k8s.io subprotocol"))
            return
        await ws.accept(subprotocol=protocol)
        argv = ws.query_params.getlist("command")
        stdin: bytes | None = None
        try:
            if _true(ws.query_params.get("stdin")):
                if protocol != "v5.channel.k8s.io":
                    raise RuntimeError("the fake reads stdin only up to a v5 close")
                data = bytearray()
                while (frame := await ws.receive_bytes()) != b"\xff\x00":
                    data += frame[1:]
                stdin = bytes(data)
            run = asyncio.ensure_future(sandbox.exec(argv, stdin=stdin))
            gone = asyncio.ensure_future(ws.receive())
            await asyncio.wait([run, gone], return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                run.cancel()  # the client went away: the local sandbox kills the command's tree
                return
            if self.hold_killed_streams and pod["status"].get("phase") == "Failed":
                while (await gone)["type"] != "websocket.disconnect":
                    gone = asyncio.ensure_future(ws.receive())
                return
            gone.cancel()
            try:
                result = run.result()
            except SandboxError:
                await ws.close()
                return
            if result.killed_by == "oom":
                ended = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
                await self._kill(pod, "", "", containerStatuses=self._container(ended))
            await ws.send_bytes(b"\x01" + result.stdout.encode())
            await ws.send_bytes(b"\x02" + result.stderr.encode())
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
            if result.exit_code != 0:
                message = f"command terminated with non-zero exit code: exit status {result.exit_code}"
                causes = [{"reason": "ExitCode", "message": str(result.exit_code)}]
                status = status | {"status": "Failure", "message": message, "reason": "NonZeroExitCode"}
                status["details"] = {"causes": causes}
            await ws.send_bytes(b"\x03" + json.dumps(status).encode())
            await ws.close()
        except WebSocketDisconnect:
            return

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(doc))
        return path


@contextlib.contextmanager
def fake_cluster(cluster: FakeCluster) -> Iterator[FakeCluster]:
    """Serves the fake API server (and runs its fake kubelet) on a free loopback port, in a thread."""
    port = free_port()
    cluster.url = f"http://127.0.0.1:{port}"
    config = uvicorn.Config(cluster.app(), host="127.0.0.1", port=port, log_level="warning", ws="auto")
    with uvicorn_in_thread(config, "the fake API server", start_timeout=60, stop_timeout=30):
        try:
            yield cluster
        finally:
            cluster.call(cluster.shutdown())
