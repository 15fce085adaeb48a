"""The built-in GUI harness: a browser agent that sees screenshots and clicks, types and scrolls.

It runs inside the rollout's sandbox, in the task's work directory, like the ReAct harness: it
starts the task's site (`openforgerl.web`) on a free loopback port, opens it in Chromium, and loops:
a screenshot (PNG; with --a11y also the page's accessibility tree and the positions of its
controls) goes to the policy in one Chat Completions call (the `openai` client, the image as an
`image_url` data URL in a user message), and the one action the policy calls is done in the
browser. It stops when the policy calls `answer`, or after --max-steps calls. When the prompt no
longer fits the model's context (the gateway's `context_length_exceeded`), the history starts over
from the newest screenshot with the task restated (`compactions` in the result) and the loop goes on.

    python -m openforgerl.harnesses.gui --base-url URL --api-key KEY --task @FILE --site NAME \\
        --max-steps 15 [--a11y] [--width 640 --height 480]

Tools: click(x, y) in screenshot pixels, type(text) into the focused field, key(key) such as Enter,
Tab, Backspace or Control+a, scroll(dy) in pixels (positive: down), navigate(url) within the site,
answer(text) to finish (for a question, the answer; for a chore, a short note). An invalid action
(unknown tool, bad arguments, no tool call, a click off the screen) costs a step and is reported to
the policy as text, never a crash.

Chromium is Debian's (/usr/bin/chromium, or --chromium), driven by Playwright's Python package;
nothing is downloaded. It runs headless, so no display or X server is needed. `--no-sandbox` turns
off Chromium's own sandbox only because it cannot nest inside ours: bubblewrap already gives the
rollout its own user and pid namespaces, and its own network namespace unless the run lets it use
the host's (for live sites).

What the page may load: with --site, the site and nothing else. With --start-url (a live site, which
the sandbox reaches only in a run with the host's network, `openforge eval --network host`), any
http(s) URL, since live pages pull scripts, fonts and images from CDNs, except loopback, private and
link-local addresses (unless the start URL is on one itself), judged by the URL's host, not by what a
name resolves to. The gateway is refused either way: its host and port, and its port on any loopback
name. A refused request fails as the browser's own blocked request; a refused navigate() is an
invalid action.

Exit status: 0 when the policy answered or used up its steps; 75 (EXIT_INFRA, sysexits' EX_TEMPFAIL)
when the environment failed before the policy acted (the site did not start, the browser did not
launch, the start page did not load), which the runner retries as an infrastructure failure and never
scores; 2 for any other failure (the model API failed, the browser broke during the episode).

It writes `.openforge/gui/step-NNN.png` (what the policy saw at each step) and
`.openforge/gui/result.json` (`{"answer", "steps", "stopped", "url", ...}`, what the verifiers
read) into the work directory, and prints one JSON line at the end.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from openforgerl.harnesses import builtin

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # bubblewrap is the sandbox: Chromium's own needs user namespaces it cannot nest
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
OUT_DIR = ".openforge/gui"
STATE = ".openforge/site.db"
A11Y_LIMIT = 6000  # characters of accessibility text per step; the rest is elided
MAX_TYPE = 1000
MAX_SCROLL = 5000
NAV_TIMEOUT_S = 10.0
EXIT_INFRA = 75  # sysexits' EX_TEMPFAIL: the environment failed, not the policy (see the module's doc)
EXIT_FAILED = 2

SYSTEM_PROMPT = (
    "You operate a web browser to do a task. Each turn you get a screenshot of the browser "
    "({width}x{height} pixels). Call exactly one tool per turn: click(x, y) at a point of the screenshot, "
    "type(text) into the field that has the focus (click it first), key(key) to press a key such as "
    "Enter, Tab, Backspace, ArrowDown or Control+a, scroll(dy) to scroll down (or up, negative), "
    "navigate(url) to open a page of the site, answer(text) when you are done: the answer for a question, "
    "otherwise a short note. You have {max_steps} turns."
)


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    types = {"x": "integer", "y": "integer", "dy": "integer"}
    properties = {p: {"type": types.get(p, "string"), "description": d} for p, d in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool("click", "Click at a point of the screenshot.", x="pixels from the left", y="pixels from the top"),
    _tool("type", "Type text into the focused field.", text="the text to type"),
    _tool("key", "Press a key or a combination.", key="e.g. Enter, Tab, Backspace, ArrowDown, Control+a"),
    _tool("scroll", "Scroll the page.", dy="pixels; positive scrolls down, negative up"),
    _tool("navigate", "Open a URL of the site (a path like /cart works).", url="the URL or path"),
    _tool("answer", "Finish the task with a short answer.", text="the answer, or a short note"),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]

# Interactive elements in view with their centres: what --a11y adds to the aria tree, so that a
# policy without pixels (or a scripted test policy) can still point at things.
_ELEMENTS_JS = """() => {
  const W = innerWidth, H = innerHeight, out = [];
  const sel = 'a[href], button, input, select, textarea, option, summary, [role=button], [role=link]';
  for (const el of document.querySelectorAll(sel)) {
    if (el.type === 'hidden') continue;
    const select = el.tagName === 'OPTION' ? el.closest('select') : null;
    if (el.tagName === 'OPTION' && !(select && (select.size > 1 || select.multiple))) continue;
    const r = el.getBoundingClientRect();
    if (r.width < 2 || r.height < 2) continue;
    const x = Math.round(r.left + r.width / 2), y = Math.round(r.top + r.height / 2);
    if (x < 0 || y < 0 || x >= W || y >= H) continue;
    const hit = document.elementFromPoint(x, y);
    const labelled = el.labels && [...el.labels].some(l => l.contains(hit));
    if (!hit || !(hit === el || el.contains(hit) || hit.contains(el) || labelled)) continue;
    const tag = el.tagName.toLowerCase(), type = (el.type || '').toLowerCase();
    let role = {a: 'link', button: 'button', select: el.size > 1 ? 'listbox' : 'combobox',
                textarea: 'textbox', option: 'option', summary: 'button'}[tag]
               || el.getAttribute('role') || 'textbox';
    if (tag === 'input') {
      role = {checkbox: 'checkbox', radio: 'radio', submit: 'button', button: 'button'}[type] || 'textbox';
    }
    const label = el.labels && el.labels.length ? el.labels[0].innerText : '';
    const text = tag === 'input' || tag === 'textarea' ? '' : el.innerText;
    const name = (el.getAttribute('aria-label') || label || text || el.placeholder || el.name || '')
      .trim().replace(/\\s+/g, ' ').slice(0, 80);
    let state = '';
    if (role === 'checkbox' || role === 'radio') state = el.checked ? ' checked' : ' unchecked';
    if (role === 'option') state = el.selected ? ' selected' : '';
    if (role === 'textbox' || role === 'combobox') {
      state = ' value=' + JSON.stringify(String(el.value).slice(0, 60));
    }
    if (el === document.activeElement) state += ' focused';
    out.push(`- ${role} ${JSON.stringify(name)}${state} at (${x}, ${y})`);
  }
  return out.join('\\n');
}"""
_EDITABLE_JS = """() => { const e = document.activeElement;
  return !!e && (e.isContentEditable || ['INPUT', 'TEXTAREA', 'SELECT'].includes(e.tagName)); }"""


class ActionError(ValueError):
    """An action the policy got wrong: reported back to it, never raised out of the loop."""


class SiteError(RuntimeError):
    """The local site did not start: the environment's fault, not the policy's."""


@dataclass
class Outcome:
    steps: int = 0  # policy calls made
    stopped: str = ""  # answered | max_steps | api_error | site_error | browser_error
    answer: str | None = None
    url: str = ""  # the page at the end (path and query: the port is meaningless afterwards)
    actions: int = 0
    invalid_actions: int = 0
    compactions: int = 0  # times the history was cut back to the newest observation (context full)
    errors: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def infra_failed(self) -> bool:
        """The environment failed before the policy acted: the site or browser did not come up."""
        return self.stopped == "site_error" or (self.stopped == "browser_error" and self.steps == 0)

    @property
    def exit_code(self) -> int:
        if self.stopped in ("answered", "max_steps"):
            return 0
        return EXIT_INFRA if self.infra_failed else EXIT_FAILED


# -- the site -------------------------------------------------------------------------------------
@contextmanager
def site_server(site: str, workdir: Path, state: str, timeout: float = 60.0) -> Iterator[str]:
    """Serve the site from a child process on a loopback port this process binds (no port race)."""
    import httpx

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    log = (workdir / OUT_DIR / "site.log").open("ab")
    argv = [sys.executable, "-m", "openforgerl.web.serve", site, "--fd", str(sock.fileno()), "--state", state]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=log, pass_fds=[sock.fileno()])
    sock.close()  # the child holds its own copy
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SiteError(f"the {site} site exited with {proc.returncode} (see {OUT_DIR}/site.log)")
            try:
                if httpx.get(url + "/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SiteError(f"the {site} site did not answer within {timeout:.0f} s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# -- the browser ----------------------------------------------------------------------------------
def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _host_port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(parts.scheme)
    except ValueError:  # a port out of range: no server there
        port = None
    return (parts.hostname or "").lower().rstrip("."), port


def _is_local(host: str) -> bool:
    """A loopback, private, link-local or unspecified address, or a name for the machine itself."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified


class Access:
    """What the page may load (see the module's doc): the site's origin only, or, for a live site,
    any http(s) origin but local addresses (unless the start URL is local); never the gateway."""

    def __init__(self, start_url: str, gateway_url: str, *, live: bool) -> None:
        self.site = None if live else _origin(start_url)
        self.local_ok = _is_local(_host_port(start_url)[0])
        self.gateway = _host_port(gateway_url)

    def is_gateway(self, url: str) -> bool:
        host, port = _host_port(url)
        gw_host, gw_port = self.gateway
        return port == gw_port and (host == gw_host or (_is_local(host) and _is_local(gw_host)))

    def allows(self, url: str) -> bool:
        if not url.startswith(("http://", "https://")):
            return url.startswith(("data:", "about:", "blob:"))
        if self.is_gateway(url):
            return False
        if self.site is not None:
            return _origin(url) == self.site
        return self.local_ok or not _is_local(_host_port(url)[0])


class Browser:
    """One page in headless Chromium, with the actions and observations of the loop."""

    def __init__(self, page: Any, width: int, height: int, access: Access) -> None:
        self.page, self.width, self.height = page, width, height
        self.access = access
        self._loading = False
        page.on("request", self._on_request)
        page.on("requestfailed", self._on_done)
        page.on("load", lambda *_: setattr(self, "_loading", False))

    def _on_request(self, request: Any) -> None:
        if request.is_navigation_request() and request.frame == self.page.main_frame:
            self._loading = True

    def _on_done(self, request: Any) -> None:
        if request.is_navigation_request() and request.frame == self.page.main_frame:
            self._loading = False

    def may_open(self, url: str) -> bool:
        return self.access.allows(url)

    def settle(self) -> None:
        """Wait for a navigation that the action started (a form post, a link) to load."""
        self.page.wait_for_timeout(60)
        deadline = time.monotonic() + NAV_TIMEOUT_S
        while self._loading and time.monotonic() < deadline:
            self.page.wait_for_timeout(30)
        self.page.wait_for_load_state("load", timeout=NAV_TIMEOUT_S * 1000)

    def screenshot(self) -> bytes:
        # caret "initial": the policy should see where the text cursor is.
        return bytes(self.page.screenshot(type="png", caret="initial", timeout=NAV_TIMEOUT_S * 1000))

    def where(self) -> str:
        parts = urlsplit(self.page.url)
        if self.access.site is not None:
            return parts.path + (f"?{parts.query}" if parts.query else "")
        return self.page.url

    def accessibility(self) -> str:
        tree = self.page.locator("body").aria_snapshot(timeout=NAV_TIMEOUT_S * 1000)
        elements = self.page.evaluate(_ELEMENTS_JS)
        text = f"Accessibility tree:\n{tree}\nControls in view (centre x, y):\n{elements}"
        if len(text) > A11Y_LIMIT:
            text = text[:A11Y_LIMIT] + f"\n[... {len(text) - A11Y_LIMIT} characters elided ...]"
        return text

    def act(self, name: str, args: dict[str, Any]) -> str:
        """Do one action; returns what happened, raises ActionError for an invalid one."""
        page = self.page
        if name == "click":
            x, y = _int(args, "x"), _int(args, "y")
            if not (0 <= x < self.width and 0 <= y < self.height):
                raise ActionError(f"({x}, {y}) is off the screen, which is {self.width}x{self.height}")
            page.mouse.click(x, y)
            self.settle()
            return f"clicked at ({x}, {y})"
        if name == "type":
            text = _str(args, "text")
            if len(text) > MAX_TYPE:
                raise ActionError(f"text too long ({len(text)} characters, {MAX_TYPE} at most)")
            if not page.evaluate(_EDITABLE_JS):
                raise ActionError("nothing to type into: click a text field first")
            page.keyboard.type(text)
            return f"typed {len(text)} characters"
        if name == "key":
            key = _str(args, "key").strip()
            if not key or len(key) > 40:
                raise ActionError("give one key name, like Enter, Tab or Control+a")
            try:
                page.keyboard.press(key)
            except Exception as exc:  # Playwright's error for a key it does not know
                raise ActionError(f"unknown key {key!r}: {str(exc).splitlines()[0]}") from exc
            self.settle()
            return f"pressed {key}"
        if name == "scroll":
            dy = _int(args, "dy")
            if abs(dy) > MAX_SCROLL:
                raise ActionError(f"scroll at most {MAX_SCROLL} pixels at once")
            page.mouse.move(self.width // 2, self.height // 2)
            page.mouse.wheel(0, dy)
            page.wait_for_timeout(100)  # the wheel scrolls asynchronously
            return f"scrolled by {dy}"
        if name == "navigate":
            url = urljoin(page.url, _str(args, "url").strip())
            if not self.may_open(url):
                where = "part of this site" if self.access.site else "reachable from this browser"
                raise ActionError(f"{url} is not {where}")
            page.goto(url, wait_until="load", timeout=NAV_TIMEOUT_S * 1000)
            return f"opened {self.where()}"
        raise ActionError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")


def _int(args: dict[str, Any], key: str) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ActionError(f"{key} must be a number, got {value!r:.40}")
    return int(value)


def _str(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise ActionError(f"{key} must be a string, got {value!r:.40}")
    return value


@contextmanager
def browser(start_url: str, width: int, height: int, access: Access, chromium: str) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            context = instance.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
            b = Browser(context.new_page(), width, height, access)

            def route(r: Any) -> None:
                if b.may_open(r.request.url):
                    r.continue_()
                else:
                    r.abort("blockedbyclient")

            context.route("**/*", route)
            # WebSockets bypass route(): the gateway's are closed unopened, the others left alone.
            context.route_web_socket(access.is_gateway, lambda ws: ws.close())
            b.page.goto(start_url, wait_until="load", timeout=NAV_TIMEOUT_S * 3000)
            yield b
        finally:
            instance.close()


# -- the loop -------------------------------------------------------------------------------------
def _image_part(png: bytes) -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
    }


class History:
    """The conversation, with at most `keep_images` screenshots sent as images.

    Every screenshot costs hundreds of prompt tokens (and a vision encoder pass), so an episode of
    50 or 100 steps cannot resend them all. Older observations become one line of text. They are
    cut in batches, not one per step: when the count goes over the limit, all but the newest are
    replaced at once. Between cuts every call extends the previous one's prompt, so the gateway's
    token memory can merge those calls into one training sequence; each cut starts a new one.
    """

    def __init__(self, system: str, keep_images: int) -> None:
        self.messages: list[Any] = [{"role": "system", "content": system}]
        self.keep_images = max(1, keep_images)
        self._with_image: list[tuple[int, str]] = []  # (message index, its text-only stand-in)

    def observe(self, png: bytes, text: str, stand_in: str) -> None:
        self.messages.append({"role": "user", "content": [_image_part(png), {"type": "text", "text": text}]})
        self._with_image.append((len(self.messages) - 1, stand_in))
        if len(self._with_image) > self.keep_images:
            for index, short in self._with_image[:-1]:
                self.messages[index] = {"role": "user", "content": short}
            self._with_image = self._with_image[-1:]

    def compact(self, png: bytes, text: str, stand_in: str) -> bool:
        """Start over from the newest observation (`text` restates the task): what a full context
        leaves. False when there is nothing left to drop, the history being that one observation."""
        if len(self.messages) <= 2:
            return False
        self.messages = self.messages[:1]
        self._with_image = []
        self.observe(png, text, stand_in)
        return True

    @property
    def images(self) -> int:
        return len(self._with_image)


def run(
    base_url: str,
    api_key: str,
    task: str,
    *,
    site: str | None = None,
    start_url: str | None = None,
    model: str = "policy",
    max_steps: int = 15,
    max_tokens: int | None = None,
    a11y: bool = False,
    width: int = 640,
    height: int = 480,
    keep_images: int = 3,
    workdir: Path = Path("."),
    state: str = STATE,
    chromium: str = CHROMIUM,
) -> Outcome:
    if (site is None) == (start_url is None):
        raise ValueError("give a site to serve or a start URL, not both")
    out_dir = workdir / OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Outcome()
    t0 = time.monotonic()
    try:
        with _site_or_url(site, start_url, workdir, state) as url:
            out.seconds["site_start"] = round(time.monotonic() - t0, 3)
            t1 = time.monotonic()
            access = Access(url, base_url, live=site is None)
            with browser(url, width, height, access, chromium) as b:
                out.seconds["browser_start"] = round(time.monotonic() - t1, 3)
                _loop(
                    b, base_url, api_key, task, model, max_steps, max_tokens, a11y, keep_images, out_dir, out
                )
    except SiteError as exc:
        out.stopped = "site_error"
        out.errors.append(str(exc))
    except Exception as exc:  # Playwright's errors: the browser failed, not the policy
        out.stopped = out.stopped if out.stopped in ("answered", "max_steps") else "browser_error"
        out.errors.append(f"{type(exc).__name__}: {str(exc)[:500]}")
    out.seconds["total"] = round(time.monotonic() - t0, 3)
    (out_dir / "result.json").write_text(json.dumps(asdict(out), indent=2))
    return out


def _loop(
    b: Browser,
    base_url: str,
    api_key: str,
    task: str,
    model: str,
    max_steps: int,
    max_tokens: int | None,
    a11y: bool,
    keep_images: int,
    out_dir: Path,
    out: Outcome,
) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=4, timeout=600)
    history = History(SYSTEM_PROMPT.format(width=b.width, height=b.height, max_steps=max_steps), keep_images)
    note = f"Task: {task}"  # what the next observation says first
    model_s = browser_s = 0.0
    try:
        while True:
            t = time.monotonic()
            png = b.screenshot()
            (out_dir / f"step-{out.steps:03d}.png").write_bytes(png)
            out.url = where = b.where()
            head = f"{note}\n" if note else ""
            text = f"Step {out.steps + 1} of {max_steps}. Page: {b.page.title()} ({where})"
            if a11y:
                text += "\n" + b.accessibility()
            stand_in = f"{head}[screenshot of {where} at step {out.steps + 1}]"
            history.observe(png, head + text, stand_in)
            browser_s += time.monotonic() - t
            if out.steps >= max_steps:
                out.stopped = "max_steps"
                return
            out.steps += 1
            t = time.monotonic()
            while True:
                try:
                    reply = client.chat.completions.create(
                        model=model,
                        messages=history.messages,
                        tools=TOOLS,  # type: ignore[arg-type]
                        max_tokens=max_tokens or openai.omit,
                    )
                    break
                except openai.APIError as exc:
                    # A full context (long replies over many steps) is compacted, as coding agents
                    # do on this error: the episode goes on from the newest screenshot and the task.
                    elided = f"Task: {task}\n[steps 1 to {out.steps - 1} elided: the context was full]\n"
                    full = isinstance(exc, openai.BadRequestError) and exc.code == "context_length_exceeded"
                    if full and history.compact(png, elided + head + text, elided + stand_in):
                        out.compactions += 1
                        continue
                    out.stopped = "api_error"
                    out.errors.append(f"{type(exc).__name__}: {exc}")
                    return
            model_s += time.monotonic() - t
            t = time.monotonic()
            note, answer = _step(b, reply.choices[0].message, history, out)
            browser_s += time.monotonic() - t
            if answer is not None:
                out.stopped, out.answer, out.url = "answered", answer, b.where()
                return
    finally:
        out.seconds |= {"model": round(model_s, 3), "browser": round(browser_s, 3)}


@contextmanager
def _site_or_url(site: str | None, start_url: str | None, workdir: Path, state: str) -> Iterator[str]:
    if site is not None:
        with site_server(site, workdir, state) as url:
            yield url
    else:
        assert start_url is not None
        yield start_url


def _step(b: Browser, msg: Any, history: History, out: Outcome) -> tuple[str, str | None]:
    """Do the policy's action: (a note for the next observation, the answer if it answered)."""
    from playwright.sync_api import Error as PlaywrightError

    history.messages.append(msg.model_dump(exclude_none=True, exclude={"reasoning_content"}))
    calls = [c for c in msg.tool_calls or [] if getattr(c, "function", None) is not None]
    if not calls:
        out.invalid_actions += 1
        return f"Invalid action: no tool call. Call exactly one of: {', '.join(TOOL_NAMES)}.", None
    first, rest = calls[0], calls[1:]
    answer = None
    try:
        args = json.loads(first.function.arguments or "{}")
        if not isinstance(args, dict):
            raise ActionError("the arguments must be a JSON object")
        if first.function.name == "answer":
            answer = _str(args, "text")
            result = "answered"
        else:
            result = b.act(first.function.name, args)
        out.actions += 1
    except (ActionError, json.JSONDecodeError) as exc:
        out.invalid_actions += 1
        result = f"Invalid action: {exc}"
    except PlaywrightError as exc:  # e.g. a page that never finished loading: the loop goes on
        out.invalid_actions += 1
        result = f"The action failed: {str(exc).splitlines()[0][:300]}"
    history.messages.append({"role": "tool", "tool_call_id": first.id, "content": result})
    for call in rest:  # one action per step: the others are answered, not done
        history.messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": "Ignored: one action per step."}
        )
    return "", answer


def main(argv: list[str] | None = None) -> int:
    ap = builtin.command_line(__doc__)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--site", help="a local site to serve: shop, booking, wiki or settings")
    where.add_argument("--start-url", help="or a URL to start at (no local site)")
    ap.add_argument("--max-steps", type=int, default=15, help="policy calls (OSWorld uses 15, 50 or 100)")
    ap.add_argument(
        "--a11y", action="store_true", help="also send the accessibility tree and control positions"
    )
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--keep-images", type=int, default=3, help="screenshots kept as images in the prompt")
    ap.add_argument("--state", default=STATE, help="the site's state file (in the work directory)")
    ap.add_argument("--chromium", default=CHROMIUM)
    a = ap.parse_args(argv)
    out = run(
        **builtin.common_args(a),
        site=a.site,
        start_url=a.start_url,
        max_steps=a.max_steps,
        a11y=a.a11y,
        width=a.width,
        height=a.height,
        keep_images=a.keep_images,
        state=a.state,
        chromium=a.chromium,
    )
    builtin.report(out)
    return out.exit_code


if __name__ == "__main__":
    sys.exit(main())
