"""A rollout's Pod and its run's parent as manifests, the names and labels they carry, and what a Pod's
status says (`assess`): pure functions of the configuration and the spec, no API call."""

from __future__ import annotations

import enum
import hashlib
import math
import re
import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openforgerl.sandbox import container
from openforgerl.sandbox.base import SandboxSpec, rewrite_gateway
from openforgerl.sandbox.container import MANAGED_BY, RUN, SANDBOX

COMPONENT = "app.kubernetes.io/component"
ROLLOUT = "openforgerl.dev/rollout"
NETWORK = "openforgerl.dev/network"
HEARTBEAT = "openforgerl.dev/heartbeat"
OURS = f"{MANAGED_BY}=openforgerl"
CONTAINER = "sandbox"
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


def pod_volumes(
    cfg: KubernetesConfig, spec: SandboxSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A Pod's volumes and the container's mounts of them: an emptyDir for the work dir, HOME, /tmp
    and each extra dir, and the harnesses' claim read-only when there is one."""
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
    return volumes, mounts


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
    workdir = container.sandbox_roots(spec)[0]
    volumes, mounts = pod_volumes(cfg, spec)
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
