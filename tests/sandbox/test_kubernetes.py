"""The Kubernetes backend: manifests, failure classification, and whole runs against a FAKE cluster.

No cluster here: the end-to-end tests talk to `openforgerl.testing.fake_kubernetes`, a FAKE API server
whose FAKE kubelet runs each Pod as a local bwrap sandbox (they skip where bubblewrap is missing).
Every object the backend creates there is validated as admission would, with kubernetes-validate
(strict, Kubernetes 1.33) plus the checks that schema cannot make (enums, quantities, names).
`test_real_cluster` runs only with KUBECONFIG set.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from openforgerl.cli import main as cli
from openforgerl.harnesses.launch import HarnessLaunch, python_binds
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import Limits, SandboxSpec, SandboxStartError, SandboxUnavailable
from openforgerl.sandbox.kubernetes import (
    KubernetesBackend,
    KubernetesConfig,
    PodState,
    assess,
    collect_garbage,
    dns_name,
    label_value,
    parent_manifest,
    pod_manifest,
)
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Task
from openforgerl.testing.fake_kubernetes import FakeCluster, Fault, fake_cluster
from tests.gateway_helpers import ScriptEngine, running_gateway
from tests.kube_helpers import word_tasks

K8S_VERSION = "1.33.0"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
IMAGE = "openforge/task:test"
NS = "default"

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_ENUMS = {
    "restartPolicy": {"Always", "OnFailure", "Never"},
    "imagePullPolicy": {"Always", "IfNotPresent", "Never"},
    "operator": {"Exists", "Equal"},
    "effect": {"NoSchedule", "PreferNoSchedule", "NoExecute"},
    "protocol": {"TCP", "UDP", "SCTP"},
    "policyTypes": {"Ingress", "Egress"},
    "type": {
        "RuntimeDefault",
        "Localhost",
        "Unconfined",
        "ClusterIP",
        "NodePort",
        "LoadBalancer",
        "Recreate",
    },
}


def own_checks(obj: dict[str, Any]) -> list[str]:
    """What kubernetes-validate's schemas let through: names, label lengths, quantities and enums."""
    errors = []
    meta = obj["metadata"]
    name_rule = _DNS_LABEL if obj["kind"] in ("Pod", "Namespace", "Service") else _DNS_SUBDOMAIN
    if not (name_rule.fullmatch(meta["name"]) and len(meta["name"]) <= 63):
        errors.append(f"name {meta['name']!r}")
    for labels in _all(obj, "labels") + _all(obj, "matchLabels") + _all(obj, "nodeSelector"):
        for key, value in labels.items():
            prefix, _, name = key.rpartition("/")
            if len(name) > 63 or not _LABEL_VALUE.fullmatch(name) or not name:
                errors.append(f"label key {key!r}")
            if prefix and not (_DNS_SUBDOMAIN.fullmatch(prefix) and len(prefix) <= 253):
                errors.append(f"label prefix {prefix!r}")
            if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
                errors.append(f"label value {value!r}")
    for resources in (r for r in _all(obj, "resources") if isinstance(r, dict)):
        for kind in ("requests", "limits"):
            for key, q in resources.get(kind, {}).items():
                if not _QUANTITY.fullmatch(str(q)):
                    errors.append(f"{kind}.{key} {q!r}")
    for key, allowed in _ENUMS.items():
        for value in _all(obj, key):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str) and v not in allowed:
                    errors.append(f"{key} {v!r}")
    for env in _all(obj, "env"):
        errors += [f"env name {e['name']!r}" for e in env if not _ENV_NAME.fullmatch(e["name"])]
    if obj["kind"] == "Pod":
        for c in obj["spec"]["containers"]:
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            # requests = limits, but a CPU request may be a share of its limit (cpu_request_fraction)
            if {k: v for k, v in requests.items() if k != "cpu"} != {
                k: v for k, v in limits.items() if k != "cpu"
            }:
                errors.append("requests differ from limits")
            if _millicores(requests.get("cpu")) > _millicores(limits.get("cpu")):
                errors.append("a CPU request above its limit")
    return errors


def _all(node: Any, key: str) -> list[Any]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                found.append(v)
            found += _all(v, key)
    elif isinstance(node, list):
        for item in node:
            found += _all(item, key)
    return found


def _millicores(quantity: str | None) -> float:
    """A CPU quantity in millicores ("500m", "2", "0.5"); 0 where absent or not a quantity."""
    found = re.fullmatch(r"([0-9.]+)(m?)", quantity or "")
    return float(found.group(1)) * (1 if found.group(2) else 1000) if found else 0.0


def admit(obj: dict[str, Any]) -> str | None:
    """What the fake API server runs on every create: a strict schema, then our own checks."""
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"schema: {e.message}"
    errors = own_checks(obj)
    return "; ".join(errors) or None


CONFIGS = {
    "plain": KubernetesConfig(run_id="run-1", image=IMAGE),
    "everything": KubernetesConfig(
        run_id="A run id/with spaces and a length far beyond what a label value may hold, surely",
        image="registry.example/task:1",
        namespace="rollouts",
        gateway_url="http://openforge-gateway.openforge.svc:8000",
        node_selector={"openforgerl.dev/pool": "rollouts"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "rollouts", "effect": "NoSchedule"}],
        runtime_class="gvisor",
        service_account="rollouts",
        image_pull_secrets=["regcred"],
        harness_claim="harnesses",
        ephemeral_storage="10Gi",
        deadline_s=7200,
        cpu_request_fraction=0.1,
    ),
}
SPECS = {
    "gateway": SandboxSpec(
        network="gateway",
        gateway_url="http://127.0.0.1:8000",
        env={"OPENAI_BASE_URL": "http://127.0.0.1:8000/r/x/v1"},
        limits=Limits(memory_bytes=2 << 30, cpus=0.5, wall_time_s=900),
    ),
    "none": SandboxSpec(limits=Limits(memory_bytes=123_456_789, cpus=2.0, wall_time_s=None)),
    "host": SandboxSpec(
        network="host",
        gateway_url="http://127.0.0.1:8000",
        env={"OPENAI_BASE_URL": "http://127.0.0.1:8000/r/x/v1"},
    ),
}


def deploy_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name not in ("kustomization.yaml", "backend.yaml"):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_generated_manifests_validate(cfg: KubernetesConfig, spec: SandboxSpec) -> None:
    name = f"{cfg.run_id}-rollout_1.A"[:64]
    pod = pod_manifest(cfg, spec, name, "0f3c0b8e-8a3c-4d1e-9c55-3b0f1a2e4d5c")
    assert admit(pod) is None
    assert admit(parent_manifest(cfg)) is None
    # The gateway as Pods see it, in env values that named it as the host does.
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    if spec.network != "none" and cfg.gateway_url:
        assert env["OPENAI_BASE_URL"] == "http://openforge-gateway.openforge.svc:8000/r/x/v1"
        assert env["OPENFORGE_GATEWAY_URL"] == cfg.gateway_url
    assert pod["metadata"]["labels"]["openforgerl.dev/network"] == spec.network
    assert pod["metadata"]["annotations"]["openforgerl.dev/sandbox"] == name


def test_cpu_requests_can_be_a_share_of_the_limits() -> None:
    """Guaranteed by default; a one-node cluster packs Burstable Pods by a share of their CPU."""
    spec = SandboxSpec(limits=Limits(memory_bytes=2 << 30, cpus=1.0))
    [plain] = pod_manifest(CONFIGS["plain"], spec, "run-1-r")["spec"]["containers"]
    assert plain["resources"]["requests"] == plain["resources"]["limits"]
    [packed] = pod_manifest(CONFIGS["everything"], spec, "run-1-r")["spec"]["containers"]
    assert packed["resources"]["limits"] == {"cpu": "1000m", "memory": "2048Mi", "ephemeral-storage": "10Gi"}
    assert packed["resources"]["requests"] == {"cpu": "100m", "memory": "2048Mi", "ephemeral-storage": "10Gi"}


@pytest.mark.parametrize("doc", deploy_documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_deploy_manifests_validate(doc: dict[str, Any]) -> None:
    assert admit(doc) is None


def test_deploy_backend_config_loads() -> None:
    cfg = KubernetesConfig.model_validate(yaml.safe_load((DEPLOY / "backend.yaml").read_text()))
    assert cfg.namespace == "openforge" and cfg.gateway_url


def test_own_checks_catch_what_the_schema_lets_through() -> None:
    pod = pod_manifest(CONFIGS["plain"], SPECS["gateway"], "run-1-x")
    pod["spec"]["restartPolicy"] = "Sometimes"
    pod["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "lots"
    pod["metadata"]["labels"]["openforgerl.dev/run"] = "x" * 64
    pod["metadata"]["name"] = "Not_A_Name"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)  # the schema is happy with all that
    errors = " | ".join(own_checks(pod))
    for expected in ("restartPolicy 'Sometimes'", "limits.cpu 'lots'", "label value", "name 'Not_A_Name'"):
        assert expected in errors


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_names_and_label_values_are_always_valid(text: str) -> None:
    value = label_value(text)
    assert len(value) <= 63 and _LABEL_VALUE.fullmatch(value)
    name = dns_name("of", text, "salt")
    assert len(name) <= 63 and _DNS_LABEL.fullmatch(name)
    assert dns_name("of", text, "other salt") != name


def _pod(phase: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "status": {"phase": phase, **status}}


def _waiting(reason: str) -> list[dict[str, Any]]:
    return [{"name": "sandbox", "state": {"waiting": {"reason": reason, "message": "m"}}}]


READY = [{"type": "Ready", "status": "True"}]


@pytest.mark.parametrize(
    ("pod", "state"),
    [
        (_pod("Pending"), PodState.PENDING),
        (_pod("Pending", containerStatuses=_waiting("ContainerCreating")), PodState.PENDING),
        (_pod("Pending", conditions=[{"type": "PodScheduled", "status": "False"}]), PodState.PENDING),
        (_pod("Running", conditions=READY), PodState.READY),
        (_pod("Pending", containerStatuses=_waiting("ImagePullBackOff")), PodState.INFRA),
        (_pod("Pending", containerStatuses=_waiting("ErrImagePull")), PodState.INFRA),
        (_pod("Pending", containerStatuses=_waiting("CreateContainerConfigError")), PodState.INFRA),
        (_pod("Failed", reason="Evicted", message="low on memory"), PodState.INFRA),
        (
            _pod("Running", conditions=[*READY, {"type": "DisruptionTarget", "status": "True"}]),
            PodState.INFRA,
        ),
        (_pod("Failed", reason="DeadlineExceeded"), PodState.DEADLINE),
        (
            _pod(
                "Failed",
                containerStatuses=[{"name": "sandbox", "state": {"terminated": {"reason": "OOMKilled"}}}],
            ),
            PodState.OOM,
        ),
        (_pod("Succeeded"), PodState.INFRA),
        (
            {"metadata": {"name": "p", "deletionTimestamp": "2025-01-01T00:00:00Z"}, "status": {}},
            PodState.INFRA,
        ),
    ],
)
def test_pod_states_are_classified(pod: dict[str, Any], state: PodState) -> None:
    assert assess(pod)[0] is state


# -- against the fake cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local() -> LocalBackend:
    backend = LocalBackend()
    if not backend.bwrap:
        pytest.skip("bubblewrap is missing: the fake kubelet needs it to give Pods their /workspace")
    return backend


@pytest.fixture(scope="module")
def cluster(local: LocalBackend) -> Iterator[FakeCluster]:
    fake = FakeCluster(
        images={IMAGE: "run", "openforge/hang:test": "hang", "openforge/crash:test": "crash"},
        ro_binds=python_binds(),
        admit=admit,
        local=local,
    )
    with fake_cluster(fake) as running:
        yield running


@pytest.fixture
def kubeconfig(cluster: FakeCluster, tmp_path: Path) -> str:
    cluster.faults.clear()
    cluster.denied.clear()
    cluster.hold_killed_streams = False
    return str(cluster.kubeconfig(tmp_path / "kubeconfig"))


def backend(kubeconfig: str, run_id: str, **kw: Any) -> KubernetesBackend:
    settings = {"image": IMAGE, "creates_per_s": 100.0, **kw}
    return KubernetesBackend(KubernetesConfig(run_id=run_id, kubeconfig=kubeconfig, **settings))


def pods_of(cluster: FakeCluster, run: str) -> list[dict[str, Any]]:
    return [p for p in cluster.stored("pods", NS) if p["metadata"]["labels"]["openforgerl.dev/run"] == run]


def wait_until(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_sandbox_runs_commands_and_moves_files(cluster: FakeCluster, kubeconfig: str, tmp_path: Path) -> None:
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f.txt").write_text("in a tree")
    (tmp_path / "tree" / "link").symlink_to("sub/f.txt")
    be = backend(kubeconfig, "life")
    spec = SandboxSpec(files={"task.txt": "hello", "/tmp/t": "x"}, limits=Limits(wall_time_s=30))

    async def go() -> None:
        async with be.create(spec, "life-r1") as sb:
            [pod] = pods_of(cluster, "life")
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "ConfigMap"
            assert pod["spec"]["activeDeadlineSeconds"] == 3 * 30 + 300
            done = await sb.exec("cat task.txt; echo $X >&2; pwd; exit 3", env={"X": "env"}, cwd="sub/..")
            assert (done.exit_code, done.stdout, done.stderr) == (3, "hello/workspace\n", "env\n")
            assert done.killed_by is None and not done.ok
            assert (await sb.exec(["sh", "-c", "cat; id -u"], stdin="piped ")).stdout == "piped 1000\n"
            await sb.put_file("a/b.sh", "echo ran", 0o755)
            await sb.put_dir(tmp_path / "tree", "/tmp/d")
            assert (await sb.exec("a/b.sh; cat /tmp/d/link")).stdout == "ran\nin a tree"
            assert await sb.get_file("/tmp/t") == b"x"
            with pytest.raises(FileNotFoundError):
                await sb.get_file("nope")
            slow = await sb.exec("sleep 30", timeout=1)
            assert slow.timed_out and slow.killed_by == "wall-time" and slow.exit_code == 137
            assert slow.duration_s < 10

    asyncio.run(go())
    wait_until(lambda: not pods_of(cluster, "life"))


def test_api_errors_are_retried_with_backoff(cluster: FakeCluster, kubeconfig: str) -> None:
    cluster.faults += [
        Fault("POST", "/pods", 429, count=2, retry_after=0.1),
        Fault("POST", "/pods", 503, count=1),
        Fault("GET", "/exec", 500, count=1),
    ]
    be = backend(kubeconfig, "retry")

    async def go() -> str:
        async with be.create(SandboxSpec(), "retry-r1") as sb:
            return (await sb.exec("echo ok")).stdout

    assert asyncio.run(go()) == "ok\n"
    assert [f.count for f in cluster.faults] == [0, 0, 0]


def test_forbidden_is_unavailable_not_retried(cluster: FakeCluster, kubeconfig: str) -> None:
    cluster.faults.append(Fault("POST", "/pods", 403, count=5))
    with pytest.raises(SandboxUnavailable, match="403"):
        asyncio.run(backend(kubeconfig, "denied").create(SandboxSpec(), "denied-r1").start())
    assert cluster.faults[0].count == 4


def test_a_refused_exec_names_the_missing_permission(cluster: FakeCluster, kubeconfig: str) -> None:
    """A refused WebSocket handshake says only 403 (a real 1.20 API server's did, in
    test_k8s_cluster.py): the error asks the API server which permission is missing."""
    cluster.faults.append(Fault("GET", "/exec", 403))
    cluster.denied.add(("get", "pods", "exec"))

    async def go() -> None:
        async with backend(kubeconfig, "noexec").create(SandboxSpec(), "noexec-r1") as sb:
            await sb.exec("true")

    with pytest.raises(
        SandboxUnavailable, match=r"forbidden: not allowed in namespace default: get pods/exec \("
    ):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("openforge/crash:test", "failed"),
        ("openforge/unknown:test", "ImagePullBackOff"),
        ("openforge/hang:test", "not ready after 2 s"),
    ],
)
def test_pods_that_do_not_start_are_infrastructure_failures(
    cluster: FakeCluster, kubeconfig: str, image: str, why: str
) -> None:
    run = f"nostart-{image.split('/')[1].split(':')[0]}"
    be = backend(kubeconfig, run, image=image, start_timeout_s=2)
    with pytest.raises(SandboxStartError, match=why):
        asyncio.run(be.create(SandboxSpec(), f"{run}-r1").start())
    wait_until(lambda: not pods_of(cluster, run))  # deleted on the way out


def test_deadline_and_oom_are_the_rollouts_own_outcomes(cluster: FakeCluster, kubeconfig: str) -> None:
    if not cluster.local.cgroups:
        pytest.skip("cgroup v1 is not writable here: the fake kubelet cannot enforce memory limits")

    async def go() -> tuple[Any, Any]:
        async with backend(kubeconfig, "deadline", deadline_s=2).create(SandboxSpec(), "deadline-r1") as sb:
            late = await sb.exec("sleep 30")
        small = SandboxSpec(limits=Limits(memory_bytes=64 << 20, wall_time_s=60))
        async with backend(kubeconfig, "oom").create(small, "oom-r1") as sb:
            hog = await sb.exec([sys.executable, "-c", "x = bytearray(512 << 20); print(len(x))"])
        return late, hog

    late, hog = asyncio.run(go())
    assert late.timed_out and late.killed_by == "wall-time"
    assert hog.killed_by == "oom" and not hog.ok


def test_a_pod_killed_under_a_command_ends_it_though_its_stream_stays_open(
    cluster: FakeCluster, kubeconfig: str
) -> None:
    """A real kubelet kills a Pod at its deadline but leaves the exec stream open (test_k8s_cluster.py
    hung there): the Pod, read while the command runs, ends it. No wall time of the sandbox's own."""
    cluster.hold_killed_streams = True
    unbounded = SandboxSpec(limits=Limits(wall_time_s=None))

    async def go() -> Any:
        async with backend(kubeconfig, "held", deadline_s=2, pod_check_s=0.3).create(
            unbounded, "held-r1"
        ) as sb:
            return await sb.exec("sleep 60")

    late = asyncio.run(go())
    assert late.timed_out and late.killed_by == "wall-time", late


def test_eviction_mid_command_is_an_infrastructure_failure(cluster: FakeCluster, kubeconfig: str) -> None:
    async def go() -> None:
        async with backend(kubeconfig, "evict").create(SandboxSpec(), "evict-r1") as sb:
            pod = sb.pod  # type: ignore[attr-defined]
            threading.Timer(1.0, cluster.evict, (NS, pod)).start()
            with pytest.raises(SandboxStartError, match="Evicted"):
                await sb.exec("sleep 30")

    asyncio.run(go())


AGENT = """\
import json, os, urllib.request
body = {"model": "m", "messages": [{"role": "user", "content": open("/tmp/task.txt").read()}]}
request = urllib.request.Request(
    os.environ["BASE"] + "/v1/chat/completions",
    data=json.dumps(body).encode(),
    headers={"authorization": "Bearer " + os.environ["KEY"], "content-type": "application/json"},
)
answer = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]["content"]
open("answer.txt", "w").write(answer)
"""


async def agent(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
    """A tiny harness: one chat call through the gateway with the rollout's key, its answer to a file."""
    argv = [sys.executable, "-I", "-S", "/tmp/agent.py"]
    return HarnessLaunch(
        argv, {"BASE": base_url, "KEY": api_key}, {"/tmp/agent.py": AGENT, "/tmp/task.txt": task.instruction}
    )


def test_runner_runs_16_rollouts_at_once_in_pods(
    cluster: FakeCluster, kubeconfig: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = ScriptEngine(tiny_model_dir)
    engine.script = lambda prompt: re.findall(r"magic-\d+-word", engine.tokenizer.decode(prompt))[-1]
    cluster.peak = 0
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="e2e",
            state_path=tmp_path / "runner.db",
            concurrency=16,
            ro_binds=[],
        )
        runner = Runner(cfg, backend(kubeconfig, "e2e", max_pods=16), agent)

        async def go() -> Any:
            try:
                return await runner.run(word_tasks(16, timeout=60))
            finally:
                await runner.close()

        results = asyncio.run(go())
    assert [(r.status, r.reward) for r in results] == [(Status.DONE, 1.0)] * 16, results[0].details
    assert cluster.peak == 16  # all at once
    created = [
        p
        for p in cluster.created
        if p.get("kind") == "Pod" and p["metadata"]["labels"]["openforgerl.dev/run"] == "e2e"
    ]
    assert len(created) == 16
    wait_until(lambda: not pods_of(cluster, "e2e"))  # each deleted with its rollout


def test_the_cap_on_pods_in_flight_holds(cluster: FakeCluster, kubeconfig: str) -> None:
    cluster.peak = 0
    be = backend(kubeconfig, "cap", max_pods=3)

    async def one(i: int) -> str:
        async with be.create(SandboxSpec(), f"cap-r{i}") as sb:
            return (await sb.exec("sleep 0.3; echo ok")).stdout

    async def go() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(go()) == ["ok\n"] * 8
    assert cluster.peak == 3


RUNNER_SCRIPT = """\
import asyncio, sys
from pathlib import Path
from openforgerl.harnesses.launch import HarnessLaunch
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox.kubernetes import KubernetesBackend, KubernetesConfig
from openforgerl.tasks import Task

gateway, token, kubeconfig, state, image = sys.argv[1:]
backend = KubernetesBackend(KubernetesConfig(run_id="crashy", image=image, kubeconfig=kubeconfig))
tasks = [Task(id=f"t{i}", instruction="x", split="test", verifier={"command": "true"}) for i in range(3)]
cfg = RunnerConfig(gateway_url=gateway, admin_token=token, run_id="crashy", state_path=Path(state))


async def sleeper(*_):
    return HarnessLaunch(["sleep", "300"], {})


runner = Runner(cfg, backend, sleeper)
asyncio.run(runner.run(tasks))
"""


def test_gc_removes_what_a_killed_runner_left(
    cluster: FakeCluster, kubeconfig: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER_SCRIPT)
    live_started, live_done = threading.Event(), threading.Event()

    async def live_run() -> None:
        # Another run, alive all along: its heartbeat keeps gc off it.
        async with backend(kubeconfig, "alive", heartbeat_s=0.3).create(SandboxSpec(), "alive-r1"):
            live_started.set()
            await asyncio.to_thread(live_done.wait, 60)

    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
        args = [gw.url, gw.gateway.admin_token, kubeconfig, str(tmp_path / "state.db"), IMAGE]
        proc = subprocess.Popen([sys.executable, str(script), *args], env=env)
        live = threading.Thread(target=asyncio.run, args=(live_run(),))
        live.start()
        try:
            wait_until(
                lambda: (
                    len([p for p in pods_of(cluster, "crashy") if p["status"].get("phase") == "Running"]) == 3
                ),
                60,
            )
            assert live_started.wait(30)
            proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
            proc.wait(10)
            # Stale means no heartbeat for --older-than seconds; the live run beats every 0.3 s. The
            # margin is wide because a loaded CI machine can delay a heartbeat by seconds.
            time.sleep(9)
            assert len(pods_of(cluster, "crashy")) == 3  # left behind
            args = ["gc", "--backend", "kubernetes", "--kubeconfig", kubeconfig, "--namespace", NS]
            dry = CliRunner().invoke(cli, [*args, "--older-than", "8", "--dry-run"])
            assert dry.exit_code == 0, dry.output
            assert "would remove configmap/openforge-run-crashy" in dry.output
            assert len(pods_of(cluster, "crashy")) == 3
            done = CliRunner().invoke(cli, [*args, "--older-than", "8"])
            assert done.exit_code == 0, done.output
            assert done.output.count("removed pod/") == 3, done.output
            wait_until(lambda: not pods_of(cluster, "crashy"))
            assert len(pods_of(cluster, "alive")) == 1  # the live run is untouched
        finally:
            live_done.set()
            live.join(30)
            if proc.poll() is None:
                proc.kill()
    wait_until(lambda: not any(name.startswith("of-crashy") for name in cluster.sandboxes))


def test_doctor_reports_access_permissions_and_policies(cluster: FakeCluster, kubeconfig: str) -> None:
    args = ["doctor", "--backend", "kubernetes", "--kubeconfig", kubeconfig, "--namespace", "openforge"]
    first = CliRunner().invoke(cli, args)
    assert first.output.startswith("python ")  # what it printed before --backend is still there
    assert "ok       api: " in first.output and "Kubernetes v1.33.0-fake" in first.output
    assert "MISSING  network policy: none in namespace openforge" in first.output
    assert first.exit_code == 1
    for doc in deploy_documents():
        if doc["kind"] == "NetworkPolicy":
            cluster.add("networkpolicies", "openforge", doc)
    cluster.denied.add(("create", "pods", "exec"))
    second = CliRunner().invoke(cli, args)
    assert "ok       network policy: openforge-rollouts-gateway-only" in second.output
    assert "MISSING  permissions: not allowed in namespace openforge: create pods/exec" in second.output
    cluster.denied.clear()
    third = CliRunner().invoke(cli, args)
    assert third.exit_code == 0, third.output


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: set KUBECONFIG")
def test_real_cluster(tmp_path: Path) -> None:
    """One sandbox on a real cluster (image OPENFORGE_TEST_IMAGE, namespace OPENFORGE_TEST_NAMESPACE)."""
    cfg = KubernetesConfig(
        run_id=f"test-{os.getpid()}",
        image=os.environ.get("OPENFORGE_TEST_IMAGE", "debian:bookworm-slim"),
        namespace=os.environ.get("OPENFORGE_TEST_NAMESPACE", "default"),
        start_timeout_s=300,
    )
    be = KubernetesBackend(cfg)

    async def go() -> None:
        async with be.create(
            SandboxSpec(files={"a.txt": "hi"}, limits=Limits(wall_time_s=60)), f"{cfg.run_id}-r"
        ) as sb:
            assert (await sb.exec("cat a.txt; id -u")).stdout == "hi1000\n"
            await sb.put_file("b.bin", bytes(range(256)))
            assert await sb.get_file("b.bin") == bytes(range(256))
            slow = await sb.exec("sleep 30", timeout=2)
            assert slow.killed_by == "wall-time"

    asyncio.run(go())
    found = asyncio.run(collect_garbage(cfg.namespace, run=cfg.run_id))
    assert [g.kind for g in found] == ["configmap"]  # the Pod went with its sandbox


def test_an_embedded_gateway_listens_where_pods_reach_it() -> None:
    """`gateway_host`: the gateway of eval/train listens there (and the backend accepts the setting)."""
    from openforgerl.sandbox.choice import BackendChoice

    assert BackendChoice("kubernetes", IMAGE, {"gateway_host": "10.217.0.1"}).gateway_host == "10.217.0.1"
    assert BackendChoice("kubernetes", IMAGE, {"gateway_host": "10.217.0.1"}).make("r").cfg.gateway_host  # type: ignore[attr-defined]
    assert BackendChoice("kubernetes", IMAGE).gateway_host == "127.0.0.1"
    assert BackendChoice("docker", IMAGE).gateway_host == "127.0.0.1"
