"""`openforge gc` for the Kubernetes backend: what crashed runs left (their parents, their Pods)."""

from __future__ import annotations

import functools
import math
import time

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from openforgerl.sandbox import container
from openforgerl.sandbox.container import RUN
from openforgerl.sandbox.kubernetes.api import load_client_config, retrying, unavailable
from openforgerl.sandbox.kubernetes.manifests import COMPONENT, HEARTBEAT, OURS, label_value


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
                        raise unavailable(f"cannot delete {item.kind} {item.name}", e) from e
    return found
