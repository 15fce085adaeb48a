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
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openforgerl.harnesses import builtin
from openforgerl.harnesses.gui_browser import (
    CHROMIUM,
    TOOL_NAMES,
    TOOLS,
    Access,
    ActionError,
    Browser,
    browser,
    str_arg,
)

__all__ = [
    "CHROMIUM",
    "TOOLS",
    "Access",
    "ActionError",
    "Browser",
    "History",
    "Outcome",
    "browser",
    "main",
    "run",
]

OUT_DIR = ".openforge/gui"
STATE = ".openforge/site.db"
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
            png, where, title, tree = b.observe(a11y)
            (out_dir / f"step-{out.steps:03d}.png").write_bytes(png)
            out.url = where
            head = f"{note}\n" if note else ""
            text = f"Step {out.steps + 1} of {max_steps}. Page: {title} ({where})"
            if tree:
                text += "\n" + tree
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
            answer = str_arg(args, "text")
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
