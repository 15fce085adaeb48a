"""The Kubernetes backend against a REAL cluster: scripts/k8s_cluster.sh's single node (kube-apiserver,
controller-manager, scheduler and a kubelet on Docker, built from Debian's source package 1.20.2).

`make test-k8s` starts it (tests/k8s_cluster.sh) and sets OPENFORGE_K8S_KUBECONFIG (the admin's),
OPENFORGE_K8S_KUBECTL, OPENFORGE_K8S_DOCKER_HOST (the engine the kubelet runs Pods on) and
OPENFORGE_K8S_POD_GATEWAY (this host as Pods reach it: a gateway listens there). What the fake API
server in test_kubernetes.py cannot show is shown here: the scheduler and kubelet starting a Pod from
a task image, exec through the API server and the kubelet, cgroup limits, the kubelet enforcing
activeDeadlineSeconds, the garbage collector following owner references, RBAC's own refusals.
NetworkPolicy is not enforced on this cluster (no policy-capable network plugin); the Pods' bridge
itself reaches only this host.
"""

from __future__ import annotations

import asyncio
import base64
import json
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

import pytest
import yaml
from click.testing import CliRunner

from openforgerl.cli import main as cli
from openforgerl.harnesses.launch import HarnessLaunch
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import Limits, SandboxSpec, SandboxStartError, SandboxUnavailable
from openforgerl.sandbox.kubernetes import KubernetesBackend, KubernetesConfig
from openforgerl.tasks import Task
from tests.gateway_helpers import ScriptEngine, running_gateway
from tests.kube_helpers import word_tasks

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(
        not os.environ.get("OPENFORGE_K8S_KUBECONFIG"), reason="needs the real cluster: make test-k8s"
    ),
]

KUBECONFIG = os.environ.get("OPENFORGE_K8S_KUBECONFIG", "")
KUBECTL = os.environ.get("OPENFORGE_K8S_KUBECTL", "kubectl")
DOCKER_HOST = os.environ.get("OPENFORGE_K8S_DOCKER_HOST", "")
POD_GATEWAY = os.environ.get("OPENFORGE_K8S_POD_GATEWAY", "")
BASE_IMAGE = os.environ.get("OPENFORGE_DOCKER_IMAGE", "openforgerl/debian:bookworm")
IMAGE = "openforgerl/k8s-task:test"
NS = "openforge-test"
# Small enough that eight Pods fit the node's two CPUs as requests (requests = limits).
SMALL = Limits(memory_bytes=256 << 20, cpus=0.2, pids=256, wall_time_s=60)


def kubectl(*args: str, kubeconfig: str = KUBECONFIG, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(
        [KUBECTL, "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
    return done.stdout


def pods(run: str, ns: str = NS) -> list[dict[str, Any]]:
    out = kubectl("get", "pods", "-n", ns, "-l", f"openforgerl.dev/run={run}", "-o", "json")
    return list(json.loads(out)["items"])


def wait_until(predicate: Any, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def image() -> str:
    """The task image, made in the kubelet's engine by scripts/k8s_task_image.py: the base image and the
    built-in harnesses' modules."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "k8s_task_image.py"
    done = subprocess.run(
        [sys.executable, str(script), BASE_IMAGE, IMAGE],
        capture_output=True,
        text=True,
        env=os.environ | {"DOCKER_HOST": DOCKER_HOST},
    )
    assert done.returncode == 0, done.stderr
    return IMAGE


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true")
    kubectl("create", "namespace", NS)
    yield NS
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false")


def backend(run_id: str, image: str, **kw: Any) -> KubernetesBackend:
    settings: dict[str, Any] = {
        "kubeconfig": KUBECONFIG,
        "namespace": NS,
        "image": image,
        "creates_per_s": 50.0,
        "start_timeout_s": 180.0,
        **kw,
    }
    return KubernetesBackend(KubernetesConfig(run_id=run_id, **settings))


def test_the_node_is_ready_and_the_api_is_loopback_only() -> None:
    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))["items"]
    assert len(nodes) == 1
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}["Ready"]
    assert ready == "True"
    server = yaml.safe_load(Path(KUBECONFIG).read_text())["clusters"][0]["cluster"]["server"]
    assert server.startswith("https://127.0.0.1:")
    version = json.loads(kubectl("version", "-o", "json"))["serverVersion"]
    assert version["gitVersion"] == "v1.20.2"
    # Every port the cluster's programs listen on is on loopback, but the kubelet's, on the Pods' bridge.
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    ours = [line.split() for line in listening.splitlines() if re.search(r'"(kube[-a-z]*|etcd)"', line)]
    assert len(ours) >= 6, listening
    for fields in ours:
        address = fields[3].rsplit(":", 1)[0]
        assert address == "127.0.0.1" or (address == POD_GATEWAY and '"kubelet"' in fields[-1]), fields


def test_a_pod_from_the_task_image_runs_commands_and_moves_files(
    image: str, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f.txt").write_text("in a tree")
    (tmp_path / "tree" / "link").symlink_to("sub/f.txt")
    be = backend("life", image)
    spec = SandboxSpec(files={"task.txt": "hello", "/tmp/t": "x"}, limits=SMALL)
    seen: dict[str, Any] = {}

    async def go() -> None:
        async with be.create(spec, "life-r1") as sb:
            [pod] = pods("life")
            seen["pod"] = pod
            done = await sb.exec("cat task.txt; echo $X >&2; pwd; exit 3", env={"X": "env"}, cwd="sub/..")
            assert (done.exit_code, done.stdout, done.stderr) == (3, "hello/workspace\n", "env\n")
            assert done.killed_by is None and not done.ok
            assert (await sb.exec("cat /etc/openforge-image")).stdout == f"{IMAGE}\n"
            assert (await sb.exec(["sh", "-c", "cat; id -u"], stdin="piped ")).stdout == "piped 1000\n"
            assert (await sb.exec("touch /root-is-read-only")).exit_code != 0
            await sb.put_file("a/b.sh", "echo ran", 0o755)
            await sb.put_dir(tmp_path / "tree", "/tmp/d")
            assert (await sb.exec("a/b.sh; cat /tmp/d/link")).stdout == "ran\nin a tree"
            await sb.put_file("bin.dat", bytes(range(256)) * 64)
            assert await sb.get_file("bin.dat") == bytes(range(256)) * 64
            assert await sb.get_file("/tmp/t") == b"x"
            with pytest.raises(FileNotFoundError):
                await sb.get_file("nope")
            # The limits are the container's cgroup's (cgroup v1 here; v2 elsewhere).
            memory = await sb.exec(
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
            )
            assert int(memory.stdout) == 256 << 20
            quota = await sb.exec(
                "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max"
            )
            assert int(quota.stdout) == 20000  # 0.2 of the 100 ms period
            slow = await sb.exec("sleep 30", timeout=2)
            assert slow.timed_out and slow.killed_by == "wall-time" and slow.exit_code == 137

    asyncio.run(go())
    pod = seen["pod"]
    assert pod["status"]["qosClass"] == "Guaranteed"  # requests = limits
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ConfigMap"
    assert pod["spec"]["activeDeadlineSeconds"] == 3 * 60 + 300
    assert [c["image"] for c in pod["spec"]["containers"]] == [image]
    wait_until(lambda: not pods("life"), what="the Pod deleted with its sandbox")


def test_the_memory_limit_kills_and_says_oom(image: str, namespace: str) -> None:
    small = SandboxSpec(limits=Limits(memory_bytes=64 << 20, cpus=0.2, wall_time_s=60))

    async def go() -> Any:
        async with backend("oom", image).create(small, "oom-r1") as sb:
            return await sb.exec(["python3", "-c", "x = bytearray(512 << 20); print(len(x))"])

    hog = asyncio.run(go())
    assert not hog.ok and hog.exit_code == 137
    assert hog.killed_by == "oom", hog


def test_the_kubelet_enforces_the_deadline(image: str, namespace: str) -> None:
    """No wall time of the sandbox's own: only the kubelet, at activeDeadlineSeconds, ends the command."""
    unbounded = SandboxSpec(limits=Limits(memory_bytes=256 << 20, cpus=0.2, wall_time_s=None))

    async def go() -> tuple[Any, dict[str, Any]]:
        async with backend("deadline", image, deadline_s=8, pod_check_s=2).create(
            unbounded, "deadline-r1"
        ) as sb:
            late = await sb.exec("sleep 600")
            [pod] = pods("deadline")
            return late, pod

    late, pod = asyncio.run(go())
    assert (pod["status"]["phase"], pod["status"]["reason"]) == ("Failed", "DeadlineExceeded")
    assert late.killed_by == "wall-time" and late.timed_out, late


def test_a_pod_deleted_under_a_command_is_an_infrastructure_failure(image: str, namespace: str) -> None:
    """Someone else deletes the Pod mid-command: the runner's to retry, not the policy's failure."""

    # No wall time: only the Pod's own end can end the command.
    unbounded = SandboxSpec(limits=Limits(memory_bytes=256 << 20, cpus=0.2, wall_time_s=None))

    async def go() -> None:
        async with backend("deleted", image, pod_check_s=2).create(unbounded, "deleted-r1") as sb:
            [pod] = pods("deleted")
            threading.Timer(
                2.0, kubectl, ("delete", "pod", "-n", NS, pod["metadata"]["name"], "--wait=false")
            ).start()
            with pytest.raises(SandboxStartError, match=r"deleted|gone"):
                await sb.exec("sleep 600")

    asyncio.run(go())
    wait_until(lambda: not pods("deleted"), what="the deleted Pod gone")


def test_deleting_a_runs_parent_deletes_its_pods(image: str, namespace: str) -> None:
    """The garbage collector (controller-manager) follows a Pod's owner reference to its run's ConfigMap."""

    async def go() -> None:
        async with backend("owned", image).create(SandboxSpec(limits=SMALL), "owned-r1"):
            [pod] = pods("owned")
            kubectl(
                "delete",
                "configmap",
                "-n",
                NS,
                "-l",
                "openforgerl.dev/run=owned,app.kubernetes.io/component=run",
            )
            await asyncio.to_thread(
                wait_until, lambda: not pods("owned"), 120, "GC of " + pod["metadata"]["name"]
            )

    asyncio.run(go())  # and the sandbox's own delete, finding the Pod gone, is no error


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

NO_INTERNET = """\
import socket
try:
    socket.create_connection(("192.0.2.1", 80), timeout=5)
    print("reached")
except OSError as e:
    print(type(e).__name__, e.errno)
"""


async def agent(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
    """One chat call through the gateway with the rollout's key (the image's python3), its answer to a
    file; first it checks that nothing but the bridge is reachable."""
    probe = await sandbox.exec(["python3", "-c", NO_INTERNET])
    argv = ["python3", "-I", "-S", "/tmp/agent.py"]
    env = {"BASE": base_url, "KEY": api_key, "PROBE": probe.stdout.strip()}
    return HarnessLaunch(argv, env, {"/tmp/agent.py": AGENT, "/tmp/task.txt": task.instruction})


def test_eight_rollouts_at_once_reach_the_gateway_and_nothing_else(
    image: str, namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = ScriptEngine(tiny_model_dir)
    engine.script = lambda prompt: re.findall(r"magic-\d+-word", engine.tokenizer.decode(prompt))[-1]
    probes: list[str] = []

    async def probing(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        launch = await agent(task, base_url, api_key, sandbox)
        probes.append(launch.env["PROBE"])
        return launch

    # Pods reach this host at the bridge's address: the gateway listens there, not on loopback.
    with running_gateway(tiny_model_dir, tmp_path, engine, host=POD_GATEWAY) as gw:
        assert gw.url.startswith(f"http://{POD_GATEWAY}:")
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="eight",
            state_path=tmp_path / "runner.db",
            concurrency=8,
            limits=SMALL,
        )
        runner = Runner(cfg, backend("eight", image, max_pods=8), probing)

        async def go() -> Any:
            try:
                return await runner.run(word_tasks(8, timeout=120))
            finally:
                await runner.close()

        results = asyncio.run(go())
    assert [(r.status, r.reward) for r in results] == [(Status.DONE, 1.0)] * 8, results[0].details
    # No route past the bridge: the address this host's own default route uses is unreachable.
    assert probes == ["OSError 101"] * 8
    wait_until(lambda: not pods("eight"), what="every Pod deleted with its rollout")


RUNNER_SCRIPT = """\
import asyncio, sys
from pathlib import Path
from openforgerl.harnesses.launch import HarnessLaunch
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import Limits
from openforgerl.sandbox.kubernetes import KubernetesBackend, KubernetesConfig
from openforgerl.tasks import Task

gateway, token, kubeconfig, state, image, ns = sys.argv[1:]
cfg = KubernetesConfig(run_id="crashy", image=image, kubeconfig=kubeconfig, namespace=ns)
backend = KubernetesBackend(cfg)
tasks = [Task(id=f"t{i}", instruction="x", split="test", verifier={"command": "true"}) for i in range(3)]
limits = Limits(memory_bytes=128 << 20, cpus=0.1)
run = RunnerConfig(
    gateway_url=gateway, admin_token=token, run_id="crashy", state_path=Path(state), limits=limits
)


async def sleeper(*_):
    return HarnessLaunch(["sleep", "300"], {})


runner = Runner(run, backend, sleeper)
asyncio.run(runner.run(tasks))
"""


def test_gc_removes_what_a_killed_runner_left(
    image: str, namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "runner.py"
    script.write_text(RUNNER_SCRIPT)
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir), host=POD_GATEWAY) as gw:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
        args = [gw.url, gw.gateway.admin_token, KUBECONFIG, str(tmp_path / "state.db"), image, NS]
        proc = subprocess.Popen([sys.executable, str(script), *args], env=env)
        try:
            wait_until(
                lambda: len([p for p in pods("crashy") if p["status"].get("phase") == "Running"]) == 3,
                180,
                "three running Pods",
            )
            proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
            proc.wait(10)
            time.sleep(4)
            assert len(pods("crashy")) == 3  # left behind
            args = ["gc", "--backend", "kubernetes", "--kubeconfig", KUBECONFIG, "--namespace", NS]
            dry = CliRunner().invoke(cli, [*args, "--older-than", "3", "--dry-run"])
            assert dry.exit_code == 0, dry.output
            assert "would remove configmap/openforge-run-crashy" in dry.output
            assert len(pods("crashy")) == 3
            done = CliRunner().invoke(cli, [*args, "--older-than", "3"])
            assert done.exit_code == 0, done.output
            assert done.output.count("removed pod/") == 3, done.output
            wait_until(lambda: not pods("crashy"), what="the killed run's Pods gone")
        finally:
            if proc.poll() is None:
                proc.kill()


def service_account_kubeconfig(name: str, path: Path) -> str:
    """A kubeconfig that authenticates as ServiceAccount `name` of NS, with the token its Secret holds."""

    def secret() -> str:
        out = kubectl(
            "get", "serviceaccount", name, "-n", NS, "-o", "jsonpath={.secrets[0].name}", check=False
        )
        return out.strip()

    wait_until(lambda: bool(secret()), 60, f"the token of serviceaccount {name}")
    token = base64.b64decode(
        kubectl("get", "secret", secret(), "-n", NS, "-o", "jsonpath={.data.token}")
    ).decode()
    doc = yaml.safe_load(Path(KUBECONFIG).read_text())
    doc["users"] = [{"name": name, "user": {"token": token}}]
    doc["contexts"][0]["context"] = {"cluster": doc["clusters"][0]["name"], "user": name, "namespace": NS}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def rbac(role: str, rules: list[dict[str, Any]]) -> str:
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": role, "namespace": NS}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": role, "namespace": NS},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": role, "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": role, "namespace": NS}],
        },
    ]
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    return role


DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def test_rbac_refusals_name_the_missing_permission(image: str, namespace: str, tmp_path: Path) -> None:
    # deploy/kubernetes/rbac.yaml's Role, less pods/exec.
    rules = next(r for r in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if r["kind"] == "Role")[
        "rules"
    ]
    no_exec = [r for r in rules if r["resources"] != ["pods/exec"]]
    kube = service_account_kubeconfig(rbac("no-exec", no_exec), tmp_path / "no-exec")
    args = ["doctor", "--backend", "kubernetes", "--kubeconfig", kube, "--namespace", NS]
    doctor = CliRunner().invoke(cli, args)
    assert (
        f"MISSING  permissions: not allowed in namespace {NS}: create pods/exec, get pods/exec"
        in doctor.output
    )
    assert "Kubernetes v1.20.2" in doctor.output

    async def exec_denied() -> None:
        async with backend("no-exec", image, kubeconfig=kube).create(
            SandboxSpec(limits=SMALL), "no-exec-r1"
        ) as sb:
            await sb.exec("true")

    with pytest.raises(SandboxUnavailable, match=r"pods/exec") as denied:
        asyncio.run(exec_denied())
    assert "forbidden" in str(denied.value)
    wait_until(lambda: not pods("no-exec"), what="the refused sandbox's Pod deleted")

    no_pods = [r for r in rules if r["resources"] != ["pods"]]
    kube2 = service_account_kubeconfig(rbac("no-pods", no_pods), tmp_path / "no-pods")
    with pytest.raises(SandboxUnavailable, match=r'cannot create resource "pods"'):
        asyncio.run(
            backend("no-pods", image, kubeconfig=kube2)
            .create(SandboxSpec(limits=SMALL), "no-pods-r1")
            .start()
        )

    # The whole Role: doctor finds every permission (the NetworkPolicy is another matter).
    kube3 = service_account_kubeconfig(rbac("runner", rules), tmp_path / "runner")
    allowed = CliRunner().invoke(cli, [*args[:-4], "--kubeconfig", kube3, "--namespace", NS])
    assert f"ok       permissions: pods, pods/exec and configmaps in namespace {NS}" in allowed.output


def test_openforge_eval_runs_rollouts_as_pods(
    image: str, namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`openforge eval --backend kubernetes`: the built-in ReAct harness in eight Pods at once, each
    rollout ending with a verdict."""
    engine = ScriptEngine(tiny_model_dir)
    engine.script = lambda prompt: "I am done."
    with running_gateway(tiny_model_dir, tmp_path, engine, host=POD_GATEWAY) as gw:
        config = tmp_path / "backend.yaml"
        config.write_text(
            yaml.safe_dump(
                # A rollout's limits are 1 CPU and 2 GiB: as requests, two Pods would fill this node.
                {
                    "kubeconfig": KUBECONFIG,
                    "namespace": NS,
                    "gateway_url": gw.url,
                    "max_pods": 8,
                    "cpu_request_fraction": 0.1,
                }
            )
        )
        out = tmp_path / "eval"
        args = [
            "eval", "--tasks", "tools-tiny", "--split", "heldout", "--limit", "8", "--harness", "react",
            "--backend", "kubernetes", "--backend-config", str(config), "--image", image,
            "--gateway", gw.url, "--admin-token", gw.gateway.admin_token, "--concurrency", "8",
            "--max-turns", "2", "--out", str(out),
        ]  # fmt: skip
        done = CliRunner().invoke(cli, args)
    assert done.exit_code in (0, 1), done.output
    report = json.loads((out / "report.json").read_text())
    assert report["rollouts"] == 8, report
    assert report["infra_failed"] == 0, report
    # Every Pod found room at once: the scheduler never had to hold one back.
    events = json.loads(
        kubectl("get", "events", "-n", NS, "--field-selector", "reason=FailedScheduling", "-o", "json")
    )
    assert [e["message"] for e in events["items"] if e["involvedObject"]["name"].startswith("of-eval-")] == []


def test_openforge_train_runs_a_grpo_step_in_pods(
    image: str, namespace: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`openforge train --backend kubernetes`: the tiny model generating every turn inside Pods, through
    the gateway the run embeds, listening where Pods reach it (`gateway_host`), then one GRPO step."""
    config = tmp_path / "backend.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeconfig": KUBECONFIG,
                "namespace": NS,
                "gateway_host": POD_GATEWAY,
                "cpu_request_fraction": 0.1,
            }
        )
    )
    out = tmp_path / "rl"
    args = [
        "train", "--tasks", "tools-tiny", "--model", str(tiny_model_dir), "--backend", "kubernetes",
        "--backend-config", str(config), "--image", image, "--steps", "1", "--group", "2",
        "--batch-tasks", "2", "--keep-zero-variance", "--max-turns", "2", "--out", str(out),
    ]  # fmt: skip
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps[-1]["step"] == 1, steps
    assert not pods("rl")  # every Pod deleted with its rollout


def test_a_pod_stuck_creating_says_why(image: str, namespace: str) -> None:
    """A Pod whose sandbox the kubelet cannot make stays Pending (ContainerCreating) and its status
    says nothing more: the error carries the Pod's last Warning event. Here: a RuntimeClass whose
    handler the node's runtime lacks (dockershim knows none)."""
    handler = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nowhere"}}
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(handler | {"handler": "nowhere"}))
    be = backend("stuck", image, runtime_class="nowhere", start_timeout_s=20)
    try:
        with pytest.raises(
            SandboxStartError,
            match=r"not ready after 20 s: .*ContainerCreating.*last warning: FailedCreatePodSandBox",
        ):
            asyncio.run(be.create(SandboxSpec(limits=SMALL), "stuck-r1").start())
    finally:
        kubectl("delete", "runtimeclass", "nowhere", "--ignore-not-found")
    wait_until(lambda: not pods("stuck"), what="the stuck Pod deleted")
