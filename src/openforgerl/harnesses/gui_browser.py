"""The GUI harness's browser: one page in headless Chromium (Debian's, driven by Playwright), what it
may load (`Access`: the site alone, or for a live site any public address; never the gateway), the
policy's tools and the actions they do (`Browser.act`), and what the policy sees of a page."""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urljoin, urlsplit

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
A11Y_LIMIT = 6000  # characters of accessibility text per step; the rest is elided
MAX_TYPE = 1000
MAX_SCROLL = 5000
NAV_TIMEOUT_S = 10.0


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

    def observe(self, a11y: bool) -> tuple[bytes, str, str, str]:
        """What the policy sees: (screenshot, where, title, accessibility text or "").

        A navigation that commits while the page is read (a form post whose request left after
        `settle` looked, on a loaded machine) destroys the page's context under the read: that is
        the page still loading, not a broken browser, so it settles and reads the new page.
        """
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        deadline = time.monotonic() + NAV_TIMEOUT_S
        while True:
            try:
                png = self.screenshot()
                return png, self.where(), self.page.title(), self.accessibility() if a11y else ""
            except PlaywrightTimeout:
                raise
            except PlaywrightError:
                if time.monotonic() >= deadline:
                    raise
                self.settle()

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
            x, y = int_arg(args, "x"), int_arg(args, "y")
            if not (0 <= x < self.width and 0 <= y < self.height):
                raise ActionError(f"({x}, {y}) is off the screen, which is {self.width}x{self.height}")
            page.mouse.click(x, y)
            self.settle()
            return f"clicked at ({x}, {y})"
        if name == "type":
            text = str_arg(args, "text")
            if len(text) > MAX_TYPE:
                raise ActionError(f"text too long ({len(text)} characters, {MAX_TYPE} at most)")
            if not page.evaluate(_EDITABLE_JS):
                raise ActionError("nothing to type into: click a text field first")
            page.keyboard.type(text)
            return f"typed {len(text)} characters"
        if name == "key":
            key = str_arg(args, "key").strip()
            if not key or len(key) > 40:
                raise ActionError("give one key name, like Enter, Tab or Control+a")
            try:
                page.keyboard.press(key)
            except Exception as exc:  # Playwright's error for a key it does not know
                raise ActionError(f"unknown key {key!r}: {str(exc).splitlines()[0]}") from exc
            self.settle()
            return f"pressed {key}"
        if name == "scroll":
            dy = int_arg(args, "dy")
            if abs(dy) > MAX_SCROLL:
                raise ActionError(f"scroll at most {MAX_SCROLL} pixels at once")
            page.mouse.move(self.width // 2, self.height // 2)
            page.mouse.wheel(0, dy)
            page.wait_for_timeout(100)  # the wheel scrolls asynchronously
            return f"scrolled by {dy}"
        if name == "navigate":
            url = urljoin(page.url, str_arg(args, "url").strip())
            if not self.may_open(url):
                where = "part of this site" if self.access.site else "reachable from this browser"
                raise ActionError(f"{url} is not {where}")
            page.goto(url, wait_until="load", timeout=NAV_TIMEOUT_S * 1000)
            return f"opened {self.where()}"
        raise ActionError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")


def int_arg(args: dict[str, Any], key: str) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ActionError(f"{key} must be a number, got {value!r:.40}")
    return int(value)


def str_arg(args: dict[str, Any], key: str) -> str:
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
