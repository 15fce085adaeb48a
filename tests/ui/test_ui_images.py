"""`openforge view` shows the images of a rollout's turns: the API names each message's images (digest,
size), serves their exact bytes by digest with immutable caching, and the page shows them as lazy
thumbnails that open at full size (marker `ui`: Debian's Chromium driven by Playwright).

The stores are written through the store's own API, in the shape the gateway records: each message
as `recorded_message` keeps it (text + image digests), the images with the call that first shows them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image as PILImage
from starlette.testclient import TestClient

from openforgerl.conversation import Message, ToolCall
from openforgerl.gateway.core import recorded_message
from openforgerl.images import Image, image_from_bytes
from openforgerl.store import CallRow, RolloutRow, Store
from openforgerl.store.sqlite import SCHEMA
from openforgerl.ui import ViewerConfig, build_app
from tests.ui_helpers import serve_viewer, shot

RUN = "gui-run"
RED, BLUE = (220, 40, 40), (40, 80, 220)
MANY = 40  # screenshots in the long rollout: far more than one screen of thumbnails


def picture(colour: tuple[int, int, int], size: tuple[int, int] = (640, 400), fmt: str = "PNG") -> Image:
    """A one-colour picture (its colour survives scaling, so a rendered thumbnail can be checked)."""
    buf = io.BytesIO()
    PILImage.new("RGB", size, colour).save(buf, format=fmt)
    return image_from_bytes(buf.getvalue())


def call_row(rollout_id: str, seq: int, messages: list[Message], response: Message, **kw: Any) -> CallRow:
    shown = kw.pop("image_digests", [])
    return CallRow(
        rollout_id=rollout_id,
        seq=seq,
        branch_id=0,
        parent_call_id=kw.pop("parent_call_id", None),
        branch_reason="",
        dialect="openai",
        model="gui-policy",
        engine="scripted",
        status="ok",
        error="",
        policy_version=0,
        prompt_prefix_len=kw.pop("prompt_prefix_len", 0),
        prompt_delta=kw.pop("prompt_delta", list(range(1, 9))),
        prompt_tokens=kw.pop("prompt_tokens", 8),
        completion_ids=[40, 41, 42],
        completion_logprobs=[-0.5, -0.25, -0.125],
        finish_reason="stop",
        stop_reason=None,
        sampling_requested={"tools": 1},
        sampling_used={"temperature": 1.0},
        messages_delta=[recorded_message(m) for m in messages],
        response=response.template_dict(),
        parse_errors=[],
        memory={},
        created_at=time.time(),
        latency_ms=12.0,
        image_digests=shown,
    )


async def _record(path: Path) -> dict[str, Any]:
    """A GUI rollout (a task with a screenshot, a click, a tool result that is only a screenshot, an
    answer), a rollout with MANY screenshots, and a JPEG; returns the ids and images by name."""
    red, blue, jpeg = picture(RED), picture(BLUE), picture((30, 160, 60), (320, 480), "JPEG")
    many = [picture((i * 6, 255 - i * 6, 128)) for i in range(MANY)]
    store = Store(path)
    try:
        now = time.time()
        for rid, task in (("r-gui", "shop-buy-socks"), ("r-many", "wiki-long-browse"), ("r-jpeg", "photo")):
            await store.create_rollout(RolloutRow(rid, RUN, task, f"k-{rid}", created_at=now))
        task = Message("user", "Buy the blue socks. Here is the screen.", images=[red])
        click = Message("assistant", "", tool_calls=[ToolCall("click", {"x": 120, "y": 80}, "call_1")])
        first = call_row(
            "r-gui", 0, [Message("system", "You operate a browser."), task], click, image_digests=[red.digest]
        )
        first_id = await store.record_call(first, [red])
        # The tool's result is the screen after the click: a screenshot and no text.
        after = Message("tool", "", tool_call_id="call_1", images=[blue])
        answer = Message("assistant", "The blue socks are in the cart.")
        second = call_row(
            "r-gui",
            1,
            [click, after],
            answer,
            parent_call_id=first_id,
            prompt_prefix_len=11,
            prompt_delta=list(range(50, 60)),
            prompt_tokens=21,
            image_digests=[red.digest, blue.digest],
        )
        await store.record_call(second, [red, blue])
        await store.update_rollout("r-gui", status="closed", reward=1.0, details={"outcome": "ok"})
        for i, im in enumerate(many):
            shown = Message("user", f"Step {i}: the page now.", images=[im])
            reply = Message("assistant", f"I scroll on (step {i}).")
            await store.record_call(call_row("r-many", i, [shown], reply, image_digests=[im.digest]), [im])
        photo = call_row(
            "r-jpeg",
            0,
            [Message("user", "", images=[jpeg])],
            Message("assistant", "A photo."),
            image_digests=[jpeg.digest],
        )
        await store.record_call(photo, [jpeg])
    finally:
        await store.close()
    return {"red": red, "blue": blue, "jpeg": jpeg, "many": many}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("gui") / "gateway.db"
    # A thread of its own: Playwright's sync API may already run an event loop in this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return path, pool.submit(asyncio.run, _record(path)).result()


@pytest.fixture(scope="module")
def api(recorded: tuple[Path, dict[str, Any]]) -> Iterator[TestClient]:
    with TestClient(build_app(ViewerConfig(store=recorded[0])), base_url="http://127.0.0.1") as client:
        yield client


def rollout(api: TestClient, rid: str, run: str = RUN) -> Any:
    r = api.get("/api/rollout", params={"run": run, "id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: Any, status: int) -> str:
    assert r.status_code == status, r.text
    message: str = r.json()["error"]["message"]
    return message


# -- the API ------------------------------------------------------------------------------------
def test_the_rollout_api_names_each_messages_images(
    api: TestClient, recorded: tuple[Path, dict[str, Any]]
) -> None:
    red, blue = recorded[1]["red"], recorded[1]["blue"]
    body = rollout(api, "r-gui")
    first, second = body["calls"]
    system, task = first["messages_delta"]
    assert "images" not in system
    assert task["content"] == "Buy the blue socks. Here is the screen."
    assert task["images"] == [
        {
            "digest": red.digest,
            "url": f"/api/images/{red.digest}?run={RUN}",
            "stored": True,
            "media_type": "image/png",
            "width": 640,
            "height": 400,
            "size": len(red.data),
        }
    ]
    tool = second["messages_delta"][1]  # a tool result that is a screenshot alone
    assert tool["role"] == "tool" and tool["content"] == ""
    assert [(i["digest"], i["width"], i["height"]) for i in tool["images"]] == [(blue.digest, 640, 400)]
    assert first["image_digests"] == [red.digest]
    assert second["image_digests"] == [red.digest, blue.digest]  # the full prompt's, in order
    # The page gets names and sizes only: the bytes come one image at a time, when shown.
    many = api.get("/api/rollout", params={"run": RUN, "id": "r-many"})
    assert len(many.content) < sum(len(im.data) for im in recorded[1]["many"])


def test_an_image_is_served_as_its_exact_bytes_and_cached_for_good(
    api: TestClient, recorded: tuple[Path, dict[str, Any]]
) -> None:
    for name, media_type in (("red", "image/png"), ("jpeg", "image/jpeg")):
        im = recorded[1][name]
        r = api.get(f"/api/images/{im.digest}", params={"run": RUN})
        assert r.status_code == 200 and r.content == im.data
        assert r.headers["content-type"] == media_type
        assert "immutable" in r.headers["cache-control"] and r.headers["etag"] == f'"{im.digest}"'
        assert r.headers["x-content-type-options"] == "nosniff"
        again = api.get(
            f"/api/images/{im.digest}", params={"run": RUN}, headers={"if-none-match": r.headers["etag"]}
        )
        assert again.status_code == 304 and again.content == b""
    upper = recorded[1]["blue"].digest.upper()  # hex is hex, whatever its case
    assert api.get(f"/api/images/{upper}", params={"run": RUN}).content == recorded[1]["blue"].data


@pytest.mark.parametrize(
    ("digest", "params", "status", "says"),
    [
        ("abc123", {"run": RUN}, 400, "64 hex digits"),
        ("g" * 64, {"run": RUN}, 400, "64 hex digits"),
        ("0" * 65, {"run": RUN}, 400, "64 hex digits"),
        ("0" * 64, {"run": RUN}, 404, f"no image {'0' * 64}"),
        ("0" * 64, {}, 400, "'run' parameter is required"),
        ("0" * 64, {"run": "other"}, 404, "no run named 'other'"),
    ],
)
def test_bad_and_unknown_digests_are_clear_errors(
    api: TestClient, digest: str, params: dict[str, str], status: int, says: str
) -> None:
    assert says in error_of(api.get(f"/api/images/{digest}", params=params), status)


def test_an_image_the_store_lost_is_marked_and_not_served(
    recorded: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    copy = tmp_path / "gateway.db"
    with (
        contextlib.closing(sqlite3.connect(recorded[0])) as src,
        contextlib.closing(sqlite3.connect(copy)) as dst,
    ):
        src.backup(dst)
        dst.execute("DELETE FROM images WHERE digest = ?", (recorded[1]["blue"].digest,))
        dst.commit()
    with TestClient(build_app(ViewerConfig(store=copy)), base_url="http://127.0.0.1") as client:
        tool = rollout(client, "r-gui")["calls"][1]["messages_delta"][1]
        assert [(i["stored"], i["width"]) for i in tool["images"]] == [(False, None)]
        assert client.get(tool["images"][0]["url"]).status_code == 404


def test_a_store_from_before_images_still_opens(tmp_path: Path) -> None:
    """An old store has neither the images table nor calls.image_digests, and the read-only viewer
    cannot add them: its rollouts show as before, without images."""
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript(SCHEMA)
    db.execute("ALTER TABLE calls DROP COLUMN image_digests")
    db.execute("DROP TABLE images")
    db.execute(
        "INSERT INTO rollouts (id, run_id, task_id, key_hash, created_at) VALUES ('old', 'r', 't', 'k', 1)"
    )
    db.execute(
        "INSERT INTO calls (rollout_id, seq, branch_id, dialect, model, engine, status, prompt_delta,"
        " prompt_tokens, completion_ids, completion_logprobs, sampling_requested, sampling_used,"
        " messages_delta, response, created_at, latency_ms) VALUES ('old', 0, 0, 'openai', 'm', 'e', 'ok',"
        " x'', 0, x'', x'', '{}', '{}', '[{\"role\": \"user\", \"content\": \"hi\"}]', '{}', 1, 1)"
    )
    db.commit()
    db.close()
    with TestClient(
        build_app(ViewerConfig(store=tmp_path / "old.db")), base_url="http://127.0.0.1"
    ) as client:
        (call,) = rollout(client, "old", run="r")["calls"]
        assert call["messages_delta"] == [{"role": "user", "content": "hi"}] and call["image_digests"] == []
        assert client.get(f"/api/images/{'a' * 64}", params={"run": "r"}).status_code == 404


# -- the browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def viewer_url(recorded: tuple[Path, dict[str, Any]]) -> Iterator[str]:
    with serve_viewer(ViewerConfig(store=recorded[0])) as url:
        yield url


# What one rendered thumbnail shows: its sizes, the colour at its centre (drawn as laid out), and the
# sha256 of the bytes its URL gave.
THUMB_JS = """async (img) => {
    const c = document.createElement("canvas");
    c.width = img.width; c.height = img.height;
    const g = c.getContext("2d");
    g.drawImage(img, 0, 0, img.width, img.height);
    const [r, gr, b] = g.getImageData(img.width >> 1, img.height >> 1, 1, 1).data;
    const bytes = await (await fetch(img.currentSrc)).arrayBuffer();
    const hash = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
    return {
        natural: [img.naturalWidth, img.naturalHeight], shown: [img.width, img.height],
        attrs: [img.getAttribute("width"), img.getAttribute("height")], loading: img.loading,
        rgb: [r, gr, b], sha256: Array.from(hash, (x) => x.toString(16).padStart(2, "0")).join(""),
    };
}"""


@pytest.mark.ui
def test_a_rollouts_screenshots_show_in_its_turns_and_open_full_size(
    browser: Any, viewer_url: str, recorded: tuple[Path, dict[str, Any]]
) -> None:
    red, blue = recorded[1]["red"], recorded[1]["blue"]
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{viewer_url}/#/run/{RUN}/rollout/r-gui")
    thumbs = page.locator("#turns .thumb img")
    thumbs.first.wait_for()
    assert thumbs.count() == 2
    page.wait_for_function(
        "() => [...document.querySelectorAll('#turns .thumb img')].every((i) => i.complete && i.naturalWidth)"
    )
    seen = [thumbs.nth(i).evaluate(THUMB_JS) for i in range(2)]
    for got, im, colour in zip(seen, (red, blue), (RED, BLUE), strict=True):
        assert got["natural"] == [640, 400] and got["loading"] == "lazy"
        assert got["attrs"] == ["360", "225"] and got["shown"] == [360, 225]  # fits the 360x240 box
        assert got["sha256"] == im.digest
        assert all(abs(a - b) <= 2 for a, b in zip(got["rgb"], colour, strict=True)), got["rgb"]
    # The tool result is a screenshot without text: shown, and not as "(empty)".
    tool = page.locator("#turns .msg.tool")
    assert tool.locator("img").get_attribute("data-digest") == blue.digest
    assert "(empty)" not in tool.inner_text() and "tool result" in tool.inner_text().lower()
    # The task section shows the task's screenshot with its text.
    assert page.locator("#task img").get_attribute("data-digest") == red.digest
    assert "Buy the blue socks" in page.inner_text("#task")
    shot(page, "07-rollout-screenshots", full_page=True)

    thumbs.nth(1).click()
    full = page.locator("dialog.lightbox[open] img")
    full.wait_for()
    page.wait_for_function("() => document.querySelector('dialog.lightbox[open] img').naturalWidth > 0")
    assert full.evaluate("(i) => i.naturalWidth") == 640
    assert blue.digest in (full.get_attribute("src") or "")
    assert "640×400" in page.inner_text("dialog.lightbox figcaption")
    shot(page, "08-screenshot-full-size")
    page.keyboard.press("Escape")
    page.wait_for_selector("dialog.lightbox", state="hidden")
    assert errors == []


@pytest.mark.ui
def test_only_the_screenshots_near_the_viewport_load(browser: Any, viewer_url: str) -> None:
    page = browser.new_page()
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url) if "/api/images/" in r.url else None)
    page.goto(f"{viewer_url}/#/run/{RUN}/rollout/r-many")
    page.locator("#turns .thumb img").first.wait_for()
    assert page.locator("#turns .thumb img").count() == MANY
    page.wait_for_function("() => document.querySelector('#turns .thumb img').naturalWidth > 0")
    page.wait_for_timeout(500)
    first_screen = len(set(requested))
    assert 0 < first_screen < MANY // 2, first_screen
    last = page.locator("#turns .thumb img").last
    assert last.evaluate("(i) => i.naturalWidth") == 0 and last.get_attribute("data-digest") not in str(
        requested
    )
    where = "() => document.querySelector('#turns .call:last-child').getBoundingClientRect().top + scrollY"
    before = page.evaluate(where)
    last.scroll_into_view_if_needed()
    page.wait_for_function(
        "() => [...document.querySelectorAll('#turns .thumb img')].at(-1).naturalWidth > 0"
    )
    # Each thumbnail's width/height held its place: the ones that loaded on the way moved nothing.
    assert abs(page.evaluate(where) - before) < 1
    assert len(set(requested)) > first_screen
