"""The backend: one run's sandboxes as Pods in one namespace, the session they share on an event
loop, and `check` (what doctor reports of a cluster)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from openforgerl.sandbox.base import BackendCheck, SandboxError, SandboxSpec, SandboxUnavailable
from openforgerl.sandbox.kubernetes.api import (
    PERMISSIONS,
    Session,
    denied_permissions,
    load_client_config,
    retrying,
)
from openforgerl.sandbox.kubernetes.manifests import KubernetesConfig
from openforgerl.sandbox.kubernetes.pod import KubernetesSandbox

log = logging.getLogger(__name__)


class KubernetesBackend:
    """Sandboxes as Pods in one namespace: see the module's doc. One backend serves one run."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesConfig) -> None:
        self.cfg = cfg
        self._session: Session | None = None
        self._opening: asyncio.Future[None] | None = None
        self._users = 0

    async def _acquire(self) -> Session:
        """The session of this event loop, opened by the first sandbox and closed with the last."""
        self._users += 1
        try:
            if self._session is None:
                self._session = Session(self.cfg)
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
