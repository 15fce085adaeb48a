"""Live web sites: the sandbox network "host" against "gateway", the runner's choice of network, the
eval options that go with it (--network, --upstream for the judge), what the GUI harness's browser
may load, and its environment failures counted as infrastructure, never as the policy's."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner

from openforgerl.cli import main
from openforgerl.gateway.upstream import UpstreamSpec
from openforgerl.harnesses import gui as gui_agent
from openforgerl.harnesses.gui import EXIT_INFRA, Access, Outcome
from openforgerl.harnesses.launch import HarnessLaunch, gui_harness
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import NetworkNotAllowed, Runner, RunnerConfig, check_network
from openforgerl.sandbox import Limits, Sandbox, SandboxSpec, SandboxUnavailable
from openforgerl.sandbox.docker import DockerBackend, DockerConfig
from openforgerl.sandbox.kubernetes import KubernetesConfig, pod_manifest
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, Task, load_tasks
from tests.gateway_helpers import ScriptEngine, running_gateway

PYTHON = os.path.realpath(sys.executable)
PY_BINDS = () if PYTHON.startswith("/usr/") else (os.path.realpath(sys.base_prefix),)
SMALL = Limits(memory_bytes=512 << 20, cpus=1.0, pids=128, wall_time_s=60)
WEBVOYAGER = Path(__file__).parents[1] / "fixtures" / "webbench" / "WebVoyager_data.jsonl"
DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
FETCH = """
import sys, urllib.request
for url in sys.argv[1:]:
    try:
        print("OK", urllib.request.urlopen(url, timeout=5).read().decode())
    except Exception as e:
        print("ERROR", type(e).__name__)
"""


class Site:
    """A web server on the host's loopback: path -> (content type, body); counts the hits per path."""

    def __init__(self, pages: dict[str, tuple[str, bytes]]) -> None:
        self.hits: collections.Counter[str] = collections.Counter()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                outer.hits[path] += 1
                kind, body = pages.get(path, ("text/plain", b"not found"))
                self.send_response(200 if path in pages else 404)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def sites() -> Iterator[tuple[Site, Site]]:
    """A stand-in for the gateway and one for a live web site, both on the host's loopback."""
    gateway = Site({"/": ("text/plain", b"gateway")})
    live = Site({"/": ("text/html", b"<title>live</title>a live page")})
    yield gateway, live
    gateway.close()
    live.close()


@pytest.fixture(scope="module")
def bwrap() -> LocalBackend:
    try:
        return LocalBackend(bwrap=True)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unusable here ({e}); CI installs the Debian package bubblewrap")


def live_task(url: str, verifier: str = "grep -q 'a live page' page.html") -> Task:
    """A task on a "live" site: the shell harness below fetches its start URL into page.html."""
    return Task(
        id="live-1",
        instruction="Open the page.",
        split="test",
        harness="gui",
        harness_options={"start_url": url},
        verifier=CommandVerifier(command=verifier),
        timeout=30,
    )


async def fetch_start_url(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
    get = "import sys, urllib.request as u; open('page.html', 'wb').write(u.urlopen(sys.argv[1]).read())"
    return HarnessLaunch([PYTHON, "-I", "-c", get, task.harness_options["start_url"]], {})


# -- the sandbox ------------------------------------------------------------------------------------


def test_host_network_reaches_the_hosts_loopback_and_gateway_network_does_not(
    bwrap: LocalBackend, sites: tuple[Site, Site]
) -> None:
    gateway, live = sites

    async def probe(network: Any) -> tuple[str | None, str, list[str]]:
        spec = SandboxSpec(network=network, gateway_url=gateway.url, limits=SMALL, ro_binds=PY_BINDS)
        sb: Sandbox = bwrap.create(spec, f"net-{network}")
        await sb.start()
        try:
            assert sb.gateway_url is not None
            r = await sb.exec([PYTHON, "-I", "-c", FETCH, f"{sb.gateway_url}/", f"{live.url}/"])
            assert r.exit_code == 0, r
            return sb.gateway_url, sb.info.network, r.stdout.splitlines()
        finally:
            await sb.stop()

    # "host": the host's own network namespace; the gateway at its host URL, and anything else.
    page = "OK <title>live</title>a live page"
    assert asyncio.run(probe("host")) == (gateway.url, "host", ["OK gateway", page])
    assert live.hits["/"] == 1
    # "gateway": the gateway through the relay, and nothing else, not even the host's loopback.
    # (The relay listens on the sandbox's own loopback at the gateway's port: the same URL inside.)
    _, network, lines = asyncio.run(probe("gateway"))
    assert network == "gateway" and lines == ["OK gateway", "ERROR URLError"]
    assert live.hits["/"] == 1 and gateway.hits["/"] == 2


def test_docker_host_network_is_the_bridge_with_the_gateway_relayed(tmp_path: Path) -> None:
    """No engine needed: the container a "host" sandbox asks for (the engine's tests run it for real)."""
    backend = DockerBackend(DockerConfig(run_id="r", image="img"))
    spec = SandboxSpec(
        network="host", gateway_url="http://127.0.0.1:8123", env={"U": "http://127.0.0.1:8123/v1"}
    )
    sb = backend.create(spec, "host-1")
    sb._dir = tmp_path  # where start() puts the relay's socket
    kwargs = sb._run_kwargs()
    assert kwargs["network_mode"] == "bridge"
    # The gateway on the host's loopback is reached through the relay, as with network "gateway".
    assert sb.gateway_url == "http://127.0.0.1:8123" and kwargs["command"][:2] == ["python3", "-I"]
    assert kwargs["environment"]["U"] == "http://127.0.0.1:8123/v1"
    assert sb.info.network == "host"
    gateway_only = backend.create(SandboxSpec(network="gateway", gateway_url="http://127.0.0.1:8123"), "gw-1")
    gateway_only._dir = tmp_path
    assert gateway_only._run_kwargs()["network_mode"] == "none"


def test_kubernetes_host_pods_get_the_gateway_and_a_policy_without_the_cluster() -> None:
    cfg = KubernetesConfig(run_id="r", image="img", gateway_url="http://openforge-gateway.openforge.svc:8000")
    spec = SandboxSpec(
        network="host", gateway_url="http://127.0.0.1:8000", env={"B": "http://127.0.0.1:8000/r/x"}
    )
    pod = pod_manifest(cfg, spec, "r-x")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["B"] == "http://openforge-gateway.openforge.svc:8000/r/x"
    label = pod["metadata"]["labels"]["openforgerl.dev/network"]
    # Every kind of rollout Pod is selected by exactly one of deploy/kubernetes' policies.
    policies = [d for d in yaml.safe_load_all((DEPLOY / "networkpolicy.yaml").read_text()) if d]
    selecting = {
        n: [p for p in policies if p["spec"]["podSelector"]["matchLabels"]["openforgerl.dev/network"] == n]
        for n in ("none", "gateway", label)
    }
    assert all(len(found) == 1 for found in selecting.values()), selecting
    [host] = selecting["host"]
    assert host["spec"]["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in host["spec"]
    blocks = [to["ipBlock"] for rule in host["spec"]["egress"] for to in rule["to"] if "ipBlock" in to]
    assert blocks and all({"10.0.0.0/8", "169.254.0.0/16"} <= set(b["except"]) for b in blocks)


# -- the runner's choice ----------------------------------------------------------------------------


def test_live_site_tasks_need_host_network_and_say_which_option(
    tiny_model_dir: Path, tmp_path: Path, sites: tuple[Site, Site]
) -> None:
    _, live = sites
    task = live_task(f"{live.url}/")
    with pytest.raises(NetworkNotAllowed, match=r"live-1.*pass --network host"):
        check_network([task], "gateway")
    check_network([task], "host")
    check_network(load_tasks("tools-tiny", split="heldout")[:2], "gateway")  # no live site, no need

    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:

        def runner(network: Any) -> Runner:
            cfg = RunnerConfig(
                gateway_url=gw.url,
                admin_token=gw.gateway.admin_token,
                run_id=f"live-{network}",
                state_path=tmp_path / f"{network}.db",
                network=network,
            )
            return Runner(cfg, LocalBackend(), fetch_start_url)

        async def go(network: Any) -> Any:
            r = runner(network)
            try:
                return await r.run([task])
            finally:
                await r.close()

        with pytest.raises(NetworkNotAllowed, match="--network host"):
            asyncio.run(go("gateway"))
        # Refused before anything started: no rollout opened, the site never asked.
        listed = httpx.get(f"{gw.url}/admin/rollouts", headers=gw.admin_headers).json()
        assert listed["rollouts"] == [] and live.hits["/"] == 0

        [r] = asyncio.run(go("host"))
    assert (r.status, r.outcome, r.reward) == (Status.DONE, "ok", 1.0), r.details
    assert live.hits["/"] == 1


def test_eval_refuses_live_sites_without_network_host_before_any_model_loads() -> None:
    args = [
        "eval",
        "--tasks",
        f"webvoyager:{WEBVOYAGER}",
        "--harness",
        "gui",
        "--gateway",
        "http://127.0.0.1:9",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "pass --network host" in result.output and "live web sites" in result.output


class _Served(Exception):
    """Stands in for the gateway starting: the test has what it wanted by then."""


@pytest.mark.parametrize("command", ["eval", "rollout", "gateway"])
def test_upstream_options_reach_the_gateway_config(
    command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[Any] = []

    def serve(cfg: Any, *args: Any) -> Any:
        seen.append(cfg)
        raise _Served

    monkeypatch.setattr("openforgerl.run.stack.serve_in_thread", serve)
    monkeypatch.setattr("openforgerl.run.stack.start_engine", lambda *a, **kw: (None, False))
    monkeypatch.setattr("openforgerl.gateway.server.serve", serve)
    upstream = ["--upstream", "judge=openai:gpt-4.1@http://127.0.0.1:9/v1"]
    upstream += ["--upstream-key-env", "judge=MY_KEY"]
    if command == "gateway":
        args = ["gateway", "--model", "m", *upstream]
    else:
        args = [command, "--tasks", f"webvoyager:{WEBVOYAGER}", "--harness", "gui", "--network", "host"]
        args += ["--model", "m", "--out", str(tmp_path), *upstream, "--upstream-timeout", "30"]
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, _Served), result.output
    # --network host let the live-site tasks through to the gateway's start.
    [cfg] = seen
    timeout = 600.0 if command == "gateway" else 30.0
    expected = UpstreamSpec("judge", "openai", "gpt-4.1", "http://127.0.0.1:9/v1", "MY_KEY", timeout)
    assert cfg.upstreams == [expected]

    bad = CliRunner().invoke(main, [*args[: args.index("--upstream")], "--upstream", "judge=gpt-4.1"])
    assert bad.exit_code == 2 and "expected NAME=KIND:MODEL[@BASE_URL]" in bad.output
    unknown = CliRunner().invoke(main, [*args, "--upstream-key-env", "teacher=X"])
    assert unknown.exit_code == 2 and "unknown upstream" in unknown.output


def test_upstreams_belong_to_the_embedded_gateway() -> None:
    args = ["eval", "--tasks", "tools-tiny", "--gateway", "http://127.0.0.1:9"]
    args += ["--upstream", "judge=openai:m"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "a running gateway (--gateway) serves its own" in result.output


# -- the GUI harness: what the page may load ----------------------------------------------------------


GATEWAY = "http://127.0.0.1:8000/r/ro_1"


@pytest.mark.parametrize(
    ("start", "live", "url", "allowed"),
    [
        # A local site: its origin only.
        ("http://127.0.0.1:4321/", False, "http://127.0.0.1:4321/cart?x=1", True),
        ("http://127.0.0.1:4321/", False, "http://127.0.0.1:4322/", False),
        ("http://127.0.0.1:4321/", False, "https://cdn.example.net/app.js", False),
        ("http://127.0.0.1:4321/", False, "data:image/png;base64,AAAA", True),
        # A live site: any public origin (its CDNs), but never local addresses or the gateway.
        ("https://www.allrecipes.com/", True, "https://www.allrecipes.com/recipes", True),
        ("https://www.allrecipes.com/", True, "https://cdn.example.net/app.js", True),
        ("https://www.allrecipes.com/", True, "http://93.184.215.14/", True),
        ("https://www.allrecipes.com/", True, "http://127.0.0.1:8000/admin/rollouts", False),
        ("https://www.allrecipes.com/", True, "http://localhost:8000/r/ro_1/v1/models", False),
        ("https://www.allrecipes.com/", True, "http://[::1]:8000/", False),
        ("https://www.allrecipes.com/", True, "http://0.0.0.0:8000/", False),
        ("https://www.allrecipes.com/", True, "http://127.0.0.1:30000/v1/models", False),
        ("https://www.allrecipes.com/", True, "http://10.0.0.7/", False),
        ("https://www.allrecipes.com/", True, "http://169.254.169.254/latest/meta-data/", False),
        ("https://www.allrecipes.com/", True, "http://[::ffff:127.0.0.1]:9000/", False),
        ("https://www.allrecipes.com/", True, "file:///etc/passwd", False),
        ("https://www.allrecipes.com/", True, "chrome://settings", False),
        # A live site that is itself local (a test server): local addresses, still not the gateway.
        ("http://127.0.0.1:4321/", True, "http://127.0.0.1:4322/", True),
        ("http://127.0.0.1:4321/", True, "http://localhost:8000/", False),
    ],
)
def test_what_the_page_may_load(start: str, live: bool, url: str, allowed: bool) -> None:
    assert Access(start, GATEWAY, live=live).allows(url) is allowed


def test_a_gateway_elsewhere_is_refused_by_host_and_port() -> None:
    access = Access("https://www.example.com/", "http://openforge-gateway.openforge.svc:8000/r/1", live=True)
    assert not access.allows("http://openforge-gateway.openforge.svc:8000/v1/models")
    assert access.allows("http://openforge-gateway.openforge.svc:8001/")  # another port: another server


@pytest.mark.ui
def test_the_browser_loads_a_live_pages_resources_but_not_the_gateways(sites: tuple[Site, Site]) -> None:
    gateway, cdn = sites
    cdn_png = "/pixel.png"
    page = f'<title>live</title><img src="{cdn.url}{cdn_png}"><img src="{gateway.url}/"><p>live page</p>'
    live = Site({"/": ("text/html", page.encode())})
    try:
        # A live site: its CDN's image loads. A local site (--site): only its own origin.
        for is_live, cdn_hits in ((True, 1), (False, 1)):
            access = Access(f"{live.url}/", f"{gateway.url}/r/ro_1", live=is_live)
            with gui_agent.browser(f"{live.url}/", 320, 240, access, gui_agent.CHROMIUM) as b:
                assert b.page.title() == "live"
            assert cdn.hits[cdn_png] == cdn_hits
        assert gateway.hits["/"] == 0 and live.hits["/"] == 2
    finally:
        live.close()


# -- the GUI harness: environment failures ---------------------------------------------------------


class NavigatingPage:
    """A fake Playwright page (no Chromium needed) whose reads fail the way a navigation that
    commits mid-read makes them fail, `failures` times, then read the new page."""

    def __init__(self, failures: int, error: type[Exception]) -> None:
        self.failures, self.error, self.settled = failures, error, 0
        self.url = "http://127.0.0.1:1/next?step=2"

    def on(self, *_: Any) -> None: ...
    def wait_for_timeout(self, _: float) -> None: ...

    def wait_for_load_state(self, *_: Any, **__: Any) -> None:
        self.settled += 1

    def screenshot(self, **_: Any) -> bytes:
        return b"png of /next"

    def title(self) -> str:
        if self.failures:
            self.failures -= 1
            raise self.error("Page.title: Execution context was destroyed, most likely by a navigation")
        return "Next"

    def locator(self, _: str) -> Any:
        return self

    def aria_snapshot(self, **_: Any) -> str:
        return "- paragraph: the next page"

    def evaluate(self, _: str) -> str:
        return "button Save (40, 20)"


@pytest.mark.ui
def test_a_navigation_during_the_observation_is_waited_for_not_a_browser_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from playwright.sync_api import Error, TimeoutError

    from openforgerl.harnesses import gui_browser

    access = Access("http://127.0.0.1:1/", "http://127.0.0.1:9/r/1", live=False)
    page = NavigatingPage(failures=2, error=Error)
    png, where, title, tree = gui_browser.Browser(page, 640, 480, access).observe(a11y=True)
    assert (png, where, title, page.settled) == (b"png of /next", "/next?step=2", "Next", 2)
    assert "paragraph: the next page" in tree and "Save (40, 20)" in tree
    # A page that never stops failing is a browser error after the navigation timeout, and a
    # timeout is one at once (it already waited).
    monkeypatch.setattr(gui_browser, "NAV_TIMEOUT_S", 0.05)
    with pytest.raises(Error, match="context was destroyed"):
        gui_browser.Browser(NavigatingPage(failures=10**9, error=Error), 640, 480, access).observe(a11y=False)
    stuck = NavigatingPage(failures=1, error=TimeoutError)
    with pytest.raises(TimeoutError):
        gui_browser.Browser(stuck, 640, 480, access).observe(a11y=False)
    assert stuck.settled == 0


def test_environment_failures_exit_with_the_infra_code(tmp_path: Path) -> None:
    base = ["--base-url", "http://127.0.0.1:9", "--api-key", "k", "--task", "t", "--workdir", str(tmp_path)]
    # The site did not start: it does not exist.
    assert gui_agent.main([*base, "--site", "no-such-site"]) == EXIT_INFRA
    result = json.loads((tmp_path / gui_agent.OUT_DIR / "result.json").read_text())
    assert (result["stopped"], result["steps"]) == ("site_error", 0) and "no-such-site" in result["errors"][0]
    # The browser did not launch: no such Chromium (or no Playwright at all).
    missing = str(tmp_path / "no-chromium")
    assert gui_agent.main([*base, "--start-url", "http://127.0.0.1:9/", "--chromium", missing]) == EXIT_INFRA
    result = json.loads((tmp_path / gui_agent.OUT_DIR / "result.json").read_text())
    assert (result["stopped"], result["steps"]) == ("browser_error", 0)
    # Failures once the policy acted are not the environment's alone: a crash (2), like an API error.
    assert Outcome(steps=3, stopped="browser_error").exit_code == 2
    assert Outcome(steps=0, stopped="api_error").exit_code == 2
    assert Outcome(steps=4, stopped="answered").exit_code == 0
    assert Outcome(steps=15, stopped="max_steps").exit_code == 0


def test_the_runner_retries_gui_environment_failures_and_never_scores_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    web = load_tasks("web-basic")[0]
    broken = web.model_copy(update={"id": "broken-site", "harness_options": {"site": "no-such-site"}})
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="gui-infra",
            state_path=tmp_path / "runner.db",
            infra_retries=1,
            on_failure="zero",
        )

        async def go(harness: Any, tasks: list[Task]) -> Any:
            runner = Runner(cfg, LocalBackend(), harness)
            try:
                return await runner.run(tasks)
            finally:
                await runner.close()

        [r] = asyncio.run(go(gui_harness(), [broken]))
        failed = httpx.get(f"{gw.url}/admin/rollouts?status=failed", headers=gw.admin_headers).json()

        # The same exit code from a harness that does not declare it is the policy's crash.
        async def exits_75(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
            return HarnessLaunch(["sh", "-c", "exit 75"], {})

        other = web.model_copy(update={"id": "exits-75"})
        [crash] = asyncio.run(go(exits_75, [other]))
    assert (r.status, r.outcome, r.reward, r.attempts) == (Status.INFRA_FAILED, "infra", None, 2)
    assert len(r.details["infra_errors"]) == 2
    assert all("site_error" in e and f"exit {EXIT_INFRA}" in e for e in r.details["infra_errors"])
    assert len(failed["rollouts"]) == 2  # each attempt's gateway rollout, closed as failed
    assert (crash.status, crash.outcome, crash.reward) == (Status.DONE, "crash", 0.0)
