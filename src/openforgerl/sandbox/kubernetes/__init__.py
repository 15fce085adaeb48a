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

The package, one seam a module: `manifests.py` (the configuration, names, labels, the Pod and the
run's parent as manifests, `assess`), `api.py` (calls with retries, credentials, permissions, the
session a backend holds), `streams.py` (the exec API's channels), `pod.py` (one sandbox: its Pod's
lifecycle, its commands, `_blame`), `backend.py` (the backend, `check`), `gc.py` (`openforge gc`).
"""

from __future__ import annotations

from openforgerl.sandbox.kubernetes.api import PERMISSIONS, denied_permissions, load_client_config, retrying
from openforgerl.sandbox.kubernetes.backend import KubernetesBackend
from openforgerl.sandbox.kubernetes.gc import collect_garbage
from openforgerl.sandbox.kubernetes.manifests import (
    COMPONENT,
    CONTAINER,
    HEARTBEAT,
    NETWORK,
    OURS,
    ROLLOUT,
    KubernetesConfig,
    PodState,
    assess,
    dns_name,
    label_value,
    parent_manifest,
    pod_deadline,
    pod_manifest,
    pod_name,
    quantity_cpu,
    quantity_memory,
)
from openforgerl.sandbox.kubernetes.pod import KubernetesSandbox
from openforgerl.sandbox.kubernetes.streams import EXEC_PROTOCOLS

__all__ = [
    "COMPONENT",
    "CONTAINER",
    "EXEC_PROTOCOLS",
    "HEARTBEAT",
    "NETWORK",
    "OURS",
    "PERMISSIONS",
    "ROLLOUT",
    "KubernetesBackend",
    "KubernetesConfig",
    "KubernetesSandbox",
    "PodState",
    "assess",
    "collect_garbage",
    "denied_permissions",
    "dns_name",
    "label_value",
    "load_client_config",
    "parent_manifest",
    "pod_deadline",
    "pod_manifest",
    "pod_name",
    "quantity_cpu",
    "quantity_memory",
    "retrying",
]
