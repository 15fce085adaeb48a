"""Images through the gateway, in every dialect, with the official SDKs: what a harness sends is what
the engine gets (same bytes, same pixels), recorded once by digest, refused with a clear 400 when it
cannot be, uploadable as files, carried to an upstream teacher, and exported self-contained.

The policy is the kit's tiny Qwen2-VL (its real VisionRenderer places and expands the image tokens);
a recording engine stands in for the model and keeps the images each call gave it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic
from click.testing import CliRunner
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from openai import OpenAI
from PIL import Image as PILImage

from openforgerl.cli import main
from openforgerl.engines.base import GenerateResult, SamplingParams
from openforgerl.gateway.upstream import UpstreamSpec
from openforgerl.images import MAX_IMAGE_BYTES, Image, file_id, image_from_bytes
from openforgerl.store import CallRow, Store
from openforgerl.store.sqlite import SCHEMA
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.vlm_helpers import screenshot

DIALECTS = ["openai", "anthropic", "gemini", "responses"]
ANSWER = "I see a screenshot."
SCREENSHOT_TOOL: Any = {
    "name": "screenshot",
    "description": "Take a screenshot.",
    "parameters": {"type": "object"},
}


class RecordingEngine(ScriptEngine):
    """The scripted engine, keeping the images each call gave it."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, lambda prompt: ANSWER)
        self.images: list[list[Image]] = []

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> GenerateResult:
        self.images.append(list(images))
        return await super().generate(prompt_ids, sampling)


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = RecordingEngine(tiny_vlm_dir)
    with running_gateway(tiny_vlm_dir, tmp_path_factory.mktemp("vlm"), engine, max_tokens=32) as gw:
        gw.engine = engine  # type: ignore[attr-defined]
        yield gw


@pytest.fixture(scope="module")
def text_gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir, lambda prompt: ANSWER)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("text"), engine, max_tokens=32) as gw:
        yield gw


def png(seed: int, width: int = 64, height: int = 48) -> bytes:
    return screenshot(width, height, seed).data


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def pixels(data: bytes) -> bytes:
    with PILImage.open(io.BytesIO(data)) as im:
        return im.convert("RGB").tobytes()


def digest(data: bytes) -> str:
    return image_from_bytes(data).digest


# -- one harness per dialect ---------------------------------------------------------------------


@dataclass
class Turn:
    """A turn of the conversation a harness plays: a user turn shows images, then its text."""

    role: str  # "user" or "assistant"
    text: str
    images: list[bytes] = field(default_factory=list)


class Harness:
    """Sends a conversation in one dialect with its official SDK; `part` builds one image part in
    that dialect's wire shape from a spec: ("b64", media_type, base64) | ("url", url) | ("file", id)."""

    name: str

    def __init__(self, rollout: dict[str, Any]) -> None:
        self.rollout = rollout

    def image(self, data: bytes) -> Any:
        return self.part(("b64", "image/png", b64(data)))

    def part(self, spec: tuple[str, ...]) -> Any:
        raise NotImplementedError

    def ask(self, turns: list[Turn], extra: Sequence[Any] = ()) -> str:
        """The answer's text. `extra` are raw image parts added to the last user turn."""
        raise NotImplementedError

    def ask_tool_result(self, image: bytes) -> str:
        """A user turn, the model's screenshot call, and its result: the image and 'Here it is.'."""
        raise NotImplementedError


class OpenAIHarness(Harness):
    name = "openai"

    def client(self) -> OpenAI:
        return OpenAI(
            base_url=self.rollout["base_url"] + "/v1", api_key=self.rollout["api_key"], max_retries=0
        )

    def part(self, spec: tuple[str, ...]) -> Any:
        if spec[0] == "file":
            return {"type": "file", "file": {"file_id": spec[1]}}
        url = spec[1] if spec[0] == "url" else f"data:{spec[1]};base64,{spec[2]}"
        return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}

    def messages(self, turns: list[Turn], extra: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        for i, t in enumerate(turns):
            if t.role == "assistant":
                out.append({"role": "assistant", "content": t.text})
                continue
            parts = [self.image(im) for im in t.images] + (list(extra) if i == len(turns) - 1 else [])
            out.append({"role": "user", "content": [*parts, {"type": "text", "text": t.text}]})
        return out

    def ask(self, turns: list[Turn], extra: Sequence[Any] = ()) -> str:
        reply = self.client().chat.completions.create(model="gpt-5", messages=self.messages(turns, extra))
        return reply.choices[0].message.content or ""

    def ask_tool_result(self, image: bytes) -> str:
        call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
        messages: Any = [
            {"role": "user", "content": "Look at the screen."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [self.image(image), {"type": "text", "text": "Here it is."}],
            },
        ]
        reply = self.client().chat.completions.create(
            model="gpt-5", messages=messages, tools=[{"type": "function", "function": SCREENSHOT_TOOL}]
        )
        return reply.choices[0].message.content or ""


class ResponsesHarness(OpenAIHarness):
    name = "responses"

    def part(self, spec: tuple[str, ...]) -> Any:
        if spec[0] == "file":
            return {"type": "input_image", "file_id": spec[1], "detail": "auto"}
        url = spec[1] if spec[0] == "url" else f"data:{spec[1]};base64,{spec[2]}"
        return {"type": "input_image", "image_url": url, "detail": "auto"}

    def ask(self, turns: list[Turn], extra: Sequence[Any] = ()) -> str:
        items: list[Any] = []
        for i, t in enumerate(turns):
            if t.role == "assistant":
                content = [{"type": "output_text", "text": t.text}]
                items.append({"type": "message", "role": "assistant", "content": content})
                continue
            parts = [self.image(im) for im in t.images] + (list(extra) if i == len(turns) - 1 else [])
            items.append({"role": "user", "content": [*parts, {"type": "input_text", "text": t.text}]})
        return self.client().responses.create(model="gpt-5", input=items).output_text

    def ask_tool_result(self, image: bytes) -> str:
        output = [self.image(image), {"type": "input_text", "text": "Here it is."}]
        items: Any = [
            {"role": "user", "content": "Look at the screen."},
            {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": output},
        ]
        tool = {"type": "function", **SCREENSHOT_TOOL}
        return self.client().responses.create(model="gpt-5", input=items, tools=[tool]).output_text  # type: ignore[list-item]


class AnthropicHarness(Harness):
    name = "anthropic"

    def client(self) -> Anthropic:
        return Anthropic(base_url=self.rollout["base_url"], api_key=self.rollout["api_key"], max_retries=0)

    def part(self, spec: tuple[str, ...]) -> Any:
        if spec[0] == "file":
            return {"type": "image", "source": {"type": "file", "file_id": spec[1]}}
        if spec[0] == "url":
            return {"type": "image", "source": {"type": "url", "url": spec[1]}}
        return {"type": "image", "source": {"type": "base64", "media_type": spec[1], "data": spec[2]}}

    def answer(self, messages: Any, **kw: Any) -> str:
        reply = self.client().messages.create(
            model="claude-sonnet-4-5", max_tokens=32, messages=messages, **kw
        )
        return "".join(b.text for b in reply.content if b.type == "text")

    def ask(self, turns: list[Turn], extra: Sequence[Any] = ()) -> str:
        messages: list[Any] = []
        for i, t in enumerate(turns):
            if t.role == "assistant":
                messages.append({"role": "assistant", "content": t.text})
                continue
            parts = [self.image(im) for im in t.images] + (list(extra) if i == len(turns) - 1 else [])
            messages.append({"role": "user", "content": [*parts, {"type": "text", "text": t.text}]})
        return self.answer(messages)

    def ask_tool_result(self, image: bytes) -> str:
        result = {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [self.image(image), {"type": "text", "text": "Here it is."}],
        }
        messages: Any = [
            {"role": "user", "content": "Look at the screen."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}],
            },
            {"role": "user", "content": [result]},
        ]
        tool = {
            "name": "screenshot",
            "description": SCREENSHOT_TOOL["description"],
            "input_schema": SCREENSHOT_TOOL["parameters"],
        }
        return self.answer(messages, tools=[tool])


class GeminiHarness(Harness):
    name = "gemini"
    model = "gemini-2.5-pro"

    def client(self) -> genai.Client:
        options = types.HttpOptions(base_url=self.rollout["base_url"])
        return genai.Client(api_key=self.rollout["api_key"], http_options=options)

    def part(self, spec: tuple[str, ...]) -> Any:
        if spec[0] in ("file", "url"):
            return types.Part.from_uri(file_uri=spec[1], mime_type="image/png")
        if spec[0] == "raw":  # base64 text the SDK cannot send as bytes (sent without the SDK)
            return {"inlineData": {"mimeType": spec[1], "data": spec[2]}}
        return types.Part.from_bytes(data=base64.b64decode(spec[2]), mime_type=spec[1])

    def contents(self, turns: list[Turn], extra: Sequence[Any]) -> list[types.Content]:
        out = []
        for i, t in enumerate(turns):
            if t.role == "assistant":
                out.append(types.Content(role="model", parts=[types.Part(text=t.text)]))
                continue
            parts = [self.image(im) for im in t.images] + (list(extra) if i == len(turns) - 1 else [])
            out.append(types.Content(role="user", parts=[*parts, types.Part(text=t.text)]))
        return out

    def ask(self, turns: list[Turn], extra: Sequence[Any] = ()) -> str:
        if any(isinstance(p, dict) for p in extra):
            return self.ask_raw(turns, extra)
        client = self.client()  # kept referenced: a collected client closes its HTTP client mid-call
        return (
            client.models.generate_content(model=self.model, contents=self.contents(turns, extra)).text or ""
        )

    def ask_raw(self, turns: list[Turn], extra: Sequence[Any]) -> str:
        """One user turn sent as JSON with httpx; a refusal raises the SDK's error from the answer."""
        assert len(turns) == 1 and not turns[0].images
        body = {"contents": [{"role": "user", "parts": [*extra, {"text": turns[0].text}]}]}
        url = f"{self.rollout['base_url']}/v1beta/models/{self.model}:generateContent"
        r = httpx.post(url, json=body, headers={"x-goog-api-key": self.rollout["api_key"]}, timeout=60)
        if r.status_code != 200:
            raise genai_errors.ClientError(r.status_code, r.json())
        return str(r.json()["candidates"][0]["content"]["parts"][0]["text"])

    def ask_tool_result(self, image: bytes) -> str:
        blob = types.FunctionResponseBlob(mime_type="image/png", data=image)
        response = types.FunctionResponse(
            name="screenshot",
            response={"output": "Here it is."},
            parts=[types.FunctionResponsePart(inline_data=blob)],
        )
        contents = [
            types.Content(role="user", parts=[types.Part(text="Look at the screen.")]),
            types.Content(
                role="model", parts=[types.Part(function_call=types.FunctionCall(name="screenshot", args={}))]
            ),
            types.Content(role="user", parts=[types.Part(function_response=response)]),
        ]
        tool = types.Tool(function_declarations=[types.FunctionDeclaration(**SCREENSHOT_TOOL)])
        client = self.client()
        config = types.GenerateContentConfig(tools=[tool])
        return client.models.generate_content(model=self.model, contents=contents, config=config).text or ""


HARNESSES: dict[str, type[Harness]] = {
    "openai": OpenAIHarness,
    "anthropic": AnthropicHarness,
    "gemini": GeminiHarness,
    "responses": ResponsesHarness,
}


def harness(dialect: str, gw: Any) -> Harness:
    return HARNESSES[dialect](new_rollout(gw))


def refusal(call: Callable[[], Any]) -> str:
    """The message of the 400 the SDK raised for `call`."""
    try:
        call()
    except (openai.BadRequestError, anthropic.BadRequestError) as exc:
        return str(exc.message)
    except genai_errors.ClientError as exc:
        assert exc.code == 400 and exc.status == "INVALID_ARGUMENT", exc
        return str(exc.message)
    raise AssertionError("the call was not refused")


def stored_images(gw: Any) -> int:
    with sqlite3.connect(gw.gateway.core.store.path) as db:
        return int(db.execute("SELECT COUNT(*) FROM images").fetchone()[0])


def image_token_runs(engine: RecordingEngine, prompt: list[int]) -> list[int]:
    pad = engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runs: list[int] = []
    for i, t in enumerate(prompt):
        if t == pad:
            if i and prompt[i - 1] == pad:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_images_reach_the_engine_and_are_recorded_once(vlm: Any, dialect: str) -> None:
    seed = 100 * DIALECTS.index(dialect)
    first, second = png(seed + 1), png(seed + 2, 80, 56)
    h = harness(dialect, vlm)
    before = stored_images(vlm)
    turns = [Turn("user", "What is on the screen?", [first])]
    for shown in ([second], []):  # three calls: the first screenshot is in all of them
        answer = h.ask(turns)
        assert answer == ANSWER
        turns += [Turn("assistant", answer), Turn("user", "And now?", shown)]
    h.ask(turns)

    engine = vlm.engine
    got = engine.images[-3:]
    assert [[im.digest for im in call] for call in got] == [
        [digest(first)],
        [digest(first), digest(second)],
        [digest(first), digest(second)],
    ]
    for sent, received in zip([first, second], got[-1], strict=True):
        assert received.data == sent and pixels(received.data) == pixels(sent)
        assert (received.media_type, received.width, received.height) == (
            "image/png",
            *PILImage.open(io.BytesIO(sent)).size,
        )
    # Each image's placeholder expanded to its own number of tokens, in the prompt the engine got.
    processor = vlm.gateway.core.renderer.processor
    assert image_token_runs(engine, engine.prompts[-1]) == [processor.image_tokens(im) for im in got[-1]]

    calls = calls_of(vlm, h.rollout["rollout_id"])
    assert [c["image_digests"] for c in calls] == [[im.digest for im in call] for call in got]
    # One branch: each call extends the last (token memory kept the images' tokens).
    assert [c["parent_call_id"] for c in calls] == [None, calls[0]["call_id"], calls[1]["call_id"]]
    assert all(c["branch_reason"] == "" for c in calls[1:])
    # The record names images by digest; the bytes are kept once, in the images table.
    assert calls[1]["messages_delta"][-1]["images"] == [digest(second)]
    assert calls[1]["messages_delta"][-1]["content"] == "And now?"
    assert b64(first)[:40] not in json.dumps(calls)
    assert stored_images(vlm) == before + 2


@pytest.mark.parametrize("dialect", DIALECTS)
def test_images_in_tool_results(vlm: Any, dialect: str) -> None:
    shot = png(1000 + DIALECTS.index(dialect))
    h = harness(dialect, vlm)
    assert h.ask_tool_result(shot) == ANSWER
    assert [im.data for im in vlm.engine.images[-1]] == [shot]
    [call] = calls_of(vlm, h.rollout["rollout_id"])
    tool = call["messages_delta"][-1]
    assert tool["role"] == "tool" and tool["images"] == [digest(shot)] and "Here it is." in tool["content"]
    # The model sees the screenshot inside the tool's response.
    prompt = vlm.engine.tokenizer.decode(vlm.engine.prompts[-1])
    assert re.search(
        r"<tool_response>\n<\|vision_start\|>(<\|image_pad\|>)+<\|vision_end\|>Here it is\.", prompt
    )


def test_gemini_images_after_a_function_response_are_its_output(vlm: Any) -> None:
    """Gemini CLI sends a tool's binary output as inlineData parts right after the functionResponse."""
    shot = png(1100)
    h = harness("gemini", vlm)
    contents = [
        types.Content(role="user", parts=[types.Part(text="Look.")]),
        types.Content(
            role="model", parts=[types.Part(function_call=types.FunctionCall(name="screenshot", args={}))]
        ),
        types.Content(
            role="user",
            parts=[
                types.Part(
                    function_response=types.FunctionResponse(name="screenshot", response={"output": "ok"})
                ),
                types.Part.from_bytes(data=shot, mime_type="image/png"),
            ],
        ),
    ]
    client = h.client()  # type: ignore[attr-defined]
    client.models.generate_content(model="gemini-2.5-pro", contents=contents)
    [call] = calls_of(vlm, h.rollout["rollout_id"])
    assert [(m["role"], m.get("images")) for m in call["messages_delta"][-1:]] == [("tool", [digest(shot)])]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_text_model_refuses_images_naming_itself(text_gw: Any, tiny_model_dir: Path, dialect: str) -> None:
    h = harness(dialect, text_gw)
    message = refusal(lambda: h.ask([Turn("user", "What is this?", [png(7)])]))
    assert f"The policy model {tiny_model_dir.name} takes no images" in message
    assert h.ask([Turn("user", "Hello?")]) == ANSWER  # the rollout goes on, in text
    assert len(calls_of(text_gw, h.rollout["rollout_id"])) == 1


@pytest.fixture(scope="module")
def huge() -> str:
    """Base64 of a payload over the image limit (random bytes: the size is refused before any decode)."""
    return b64(os.urandom(MAX_IMAGE_BYTES + 1024))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_bad_images_are_refused_in_the_dialect_and_the_rollout_goes_on(
    vlm: Any, dialect: str, huge: str
) -> None:
    h = harness(dialect, vlm)
    wide = io.BytesIO()
    PILImage.new("RGB", (9000, 10), (200, 30, 30)).save(wide, format="PNG")
    malformed = ("raw" if dialect == "gemini" else "b64", "image/png", "@@not base64@@")
    cases: list[tuple[tuple[str, ...], str]] = [
        (("b64", "image/png", b64(wide.getvalue())), "9000x10 pixels; the limit is 8000 per side"),
        (("b64", "image/png", huge), f"over the limit of {MAX_IMAGE_BYTES} bytes"),
        (malformed, "base64 data is malformed"),
        (("b64", "image/png", b64(b"plain text, not a picture")), "not an image"),
        (("url", "https://example.com/cat.png"), "inline only|fetches nothing"),
        (("file", file_id("0" * 64)), "unknown file"),
    ]
    for spec, words in cases:
        part = h.part(spec)
        message = refusal(lambda: h.ask([Turn("user", "What is this?")], [part]))  # noqa: B023
        assert re.search(words, message), (spec[0], message)
        assert "Invalid image at" in message or spec[0] == "url", message
    shot = png(2000 + DIALECTS.index(dialect))
    assert h.ask([Turn("user", "What is this?", [shot])]) == ANSWER
    [call] = calls_of(vlm, h.rollout["rollout_id"])  # the refused calls left no record
    assert call["image_digests"] == [digest(shot)]


def test_the_declared_media_type_is_not_trusted(vlm: Any) -> None:
    jpeg = io.BytesIO()
    PILImage.new("RGB", (40, 30), (10, 120, 200)).save(jpeg, format="JPEG")
    h = harness("anthropic", vlm)
    h.ask([Turn("user", "What is this?")], [h.part(("b64", "image/png", b64(jpeg.getvalue())))])
    [received] = vlm.engine.images[-1]
    assert (received.media_type, received.data) == ("image/jpeg", jpeg.getvalue())
    r = httpx.get(f"{vlm.url}/admin/images/{received.digest}", headers=vlm.admin_headers)
    assert r.headers["content-type"] == "image/jpeg" and r.content == jpeg.getvalue()


def test_token_memory_tells_screenshots_apart(vlm: Any) -> None:
    """The same words with another screenshot are another message: no call extends a branch whose
    screenshots differ from its own."""
    a, b, c = png(3001), png(3002), png(3003)
    h = harness("openai", vlm)
    answer = h.ask([Turn("user", "What now?", [a])])
    h.ask([Turn("user", "What now?", [a]), Turn("assistant", answer), Turn("user", "Next?", [b])])
    h.ask([Turn("user", "What now?", [c]), Turn("assistant", answer), Turn("user", "Next?", [b])])
    h.ask([Turn("user", "What now?", [a]), Turn("assistant", answer), Turn("user", "Next?", [c])])
    first, extended, other_first, other_last = calls_of(vlm, h.rollout["rollout_id"])
    assert extended["parent_call_id"] == first["call_id"] and extended["branch_reason"] == ""
    assert other_first["parent_call_id"] is None
    assert (
        other_first["branch_reason"] == "message 0 differs from the recorded conversation (history rewritten)"
    )
    # The same history as `extended` with another last screenshot: a fork of the first call.
    assert other_last["parent_call_id"] == first["call_id"]
    assert other_last["branch_id"] != extended["branch_id"]
    assert [c["image_digests"] for c in (extended, other_first, other_last)] == [
        [digest(a), digest(b)],
        [digest(c), digest(b)],
        [digest(a), digest(c)],
    ]
    prompts = vlm.engine.prompts[-4:]
    assert prompts[3][: len(prompts[0])] == prompts[0]  # the fork reused the first call's tokens
    processor = vlm.gateway.core.renderer.processor
    tokens = [processor.image_tokens(image_from_bytes(x)) for x in (a, c)]
    assert image_token_runs(vlm.engine, prompts[3]) == tokens


def test_uploaded_files_in_every_dialect(vlm: Any) -> None:
    shot = png(4001)
    ro = new_rollout(vlm)
    client = OpenAIHarness(ro).client()
    uploaded = client.files.create(file=("screen.png", shot, "image/png"), purpose="vision")
    assert uploaded.id == file_id(digest(shot)) and uploaded.bytes == len(shot)
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == shot
    # Anthropic's SDK uploads to the same endpoint and gets its own shape.
    claude = AnthropicHarness(ro).client()
    meta = claude.beta.files.upload(file=("screen.png", shot, "image/png"))
    assert (meta.id, meta.mime_type, meta.size_bytes) == (uploaded.id, "image/png", len(shot))
    assert claude.beta.files.retrieve_metadata(meta.id).filename.endswith(".png")

    for dialect in DIALECTS:
        h = HARNESSES[dialect](ro)
        h.ask([Turn("user", "What is this?")], [h.part(("file", uploaded.id))])
        assert [im.data for im in vlm.engine.images[-1]] == [shot], dialect
    # Chat Completions also takes the file id in an image_url.
    OpenAIHarness(ro).ask(
        [Turn("user", "And this?")], [{"type": "image_url", "image_url": {"url": uploaded.id}}]
    )
    assert [im.data for im in vlm.engine.images[-1]] == [shot]

    with pytest.raises(openai.BadRequestError, match="not an image"):
        client.files.create(file=("notes.txt", b"just text", "text/plain"), purpose="user_data")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id("f" * 64))
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=vlm.url + "/v1", api_key="wrong", max_retries=0).files.create(
            file=("screen.png", shot, "image/png"), purpose="vision"
        )


@pytest.mark.parametrize("dialect", DIALECTS)
def test_an_upload_is_its_rollouts_own(vlm: Any, dialect: str) -> None:
    """Another rollout's key cannot read an uploaded file, name it in a message, or learn that it
    exists: its id answers as an unknown one does."""
    shot = png(4101)
    owner = OpenAIHarness(new_rollout(vlm)).client()
    uploaded = owner.files.create(file=("secret.png", shot, "image/png"), purpose="vision")
    other_ro = new_rollout(vlm)
    other = OpenAIHarness(other_ro).client()
    for read in (other.files.retrieve, other.files.content):
        with pytest.raises(openai.NotFoundError) as err:
            read(uploaded.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            read(file_id("e" * 64))
        assert err.value.message.replace(uploaded.id, "ID") == unknown.value.message.replace(
            file_id("e" * 64), "ID"
        )
    h = HARNESSES[dialect](other_ro)
    assert "file" in refusal(lambda: h.ask([Turn("user", "What is this?")], [h.part(("file", uploaded.id))]))
    # The same bytes uploaded by the other rollout are its own from then on (same id: by content).
    assert other.files.create(file=("mine.png", shot, "image/png"), purpose="vision").id == uploaded.id
    assert other.files.content(uploaded.id).content == shot
    h.ask([Turn("user", "What is this?")], [h.part(("file", uploaded.id))])
    assert [im.data for im in vlm.engine.images[-1]] == [shot]


def test_a_text_model_refuses_images_before_decoding_them(
    text_gw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding is the costly part (an 8000x8000 PNG takes seconds): a model that reads no images
    refuses the first image part before any is decoded."""
    import openforgerl.images as images

    decoded: list[int] = []
    real = images.image_from_bytes
    monkeypatch.setattr(images, "image_from_bytes", lambda data: decoded.append(len(data)) or real(data))
    for dialect in DIALECTS:
        ask = harness(dialect, text_gw).ask
        assert "takes no images" in refusal(lambda: ask([Turn("user", "What is this?", [png(7), png(8)])]))  # noqa: B023
    assert decoded == []


def test_admin_image_endpoint(vlm: Any) -> None:
    shot = png(5001)
    h = harness("openai", vlm)
    h.ask([Turn("user", "What is this?", [shot])])
    url = f"{vlm.url}/admin/images/{digest(shot)}"
    r = httpx.get(url, headers=vlm.admin_headers)
    assert r.status_code == 200 and r.content == shot and r.headers["content-type"] == "image/png"
    assert httpx.get(url, headers={"authorization": f"Bearer {h.rollout['api_key']}"}).status_code == 401
    missing = httpx.get(f"{vlm.url}/admin/images/{'0' * 64}", headers=vlm.admin_headers)
    assert missing.status_code == 404 and "No image" in missing.json()["error"]["message"]


def test_a_restarted_gateway_keeps_images_and_files(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    shot, later = png(6001), png(6002)
    engine = RecordingEngine(tiny_vlm_dir)
    with running_gateway(tiny_vlm_dir, tmp_path, engine) as gw:
        ro = new_rollout(gw)
        h = OpenAIHarness(ro)
        uploaded = h.client().files.create(file=("screen.png", later, "image/png"), purpose="vision")
        answer = h.ask([Turn("user", "What is this?", [shot])])
    engine = RecordingEngine(tiny_vlm_dir)
    with running_gateway(tiny_vlm_dir, tmp_path, engine) as gw:
        h = OpenAIHarness({**ro, "base_url": f"{gw.url}/r/{ro['rollout_id']}"})  # the same key, a new port
        turns = [Turn("user", "What is this?", [shot]), Turn("assistant", answer), Turn("user", "And this?")]
        h.ask(turns, [h.part(("file", uploaded.id))])
        assert [im.data for im in engine.images[-1]] == [shot, later]
        first, second = calls_of(gw, ro["rollout_id"])
        assert second["parent_call_id"] == first["call_id"]  # token memory rebuilt from the store
        assert first["image_digests"] == [digest(shot)]
        r = httpx.get(f"{gw.url}/admin/images/{digest(shot)}", headers=gw.admin_headers)
        assert r.content == shot


def test_an_old_store_migrates_and_keeps_images_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old_schema = SCHEMA.replace(",\n    image_digests TEXT NOT NULL DEFAULT '[]'", "")
    old_schema = old_schema[: old_schema.index("-- Each image once")]
    with sqlite3.connect(path) as db:
        db.executescript(old_schema)
        db.execute("INSERT INTO rollouts (id, key_hash, created_at) VALUES ('ro_1', 'k', 1.0)")
        db.execute(
            "INSERT INTO calls (rollout_id, seq, branch_id, dialect, model, engine, status, prompt_delta, "
            "prompt_tokens, completion_ids, completion_logprobs, sampling_requested, sampling_used, "
            "messages_delta, response, created_at, latency_ms) "
            "VALUES ('ro_1', 0, 0, 'openai', 'm', 'e', 'ok', x'', 0, x'', x'', '{}', '{}', '[]', '{}', "
            "1.0, 1.0)"
        )
    shot = image_from_bytes(png(7001))

    def row(seq: int, shows: str) -> CallRow:
        return CallRow(
            rollout_id="ro_1", seq=seq, branch_id=0, parent_call_id=None, branch_reason="", dialect="openai",
            model="m", engine="e", status="ok", error="", policy_version=0, prompt_prefix_len=0,
            prompt_delta=[1, 2], prompt_tokens=2, completion_ids=[3], completion_logprobs=[-0.5],
            finish_reason="stop", stop_reason=None, sampling_requested={}, sampling_used={},
            messages_delta=[{"role": "user", "content": "q", "images": [shows]}], response={},
            parse_errors=[], memory={}, created_at=2.0, latency_ms=1.0, image_digests=[shows],
        )  # fmt: skip

    async def write() -> None:
        store = Store(path)
        try:
            await store.record_call(row(1, shot.digest), [shot])
            await store.record_call(row(2, shot.digest), [shot])  # shown again: kept once
            with pytest.raises(ValueError, match="does not carry"):
                await store.record_call(row(3, "e" * 64))  # an image the store lacks, without its bytes
        finally:
            await store.close()

    async def read() -> tuple[list[CallRow], dict[str, Image]]:
        store = Store(path)
        try:
            return await store.calls("ro_1"), await store.images([shot.digest, "0" * 64])
        finally:
            await store.close()

    asyncio.run(write())
    calls, images = asyncio.run(read())
    assert [c.image_digests for c in calls] == [[], [shot.digest], [shot.digest]]
    assert images == {shot.digest: shot}
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM images").fetchone()[0] == 1


def test_upstream_teachers_see_the_images(
    tiny_model_dir: Path, tiny_vlm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text policy's gateway sends an image rollout to a VLM teacher (a second gateway of ours, in
    both APIs): the user's screenshot and a tool's screenshot reach the teacher's model."""
    teacher_engine = RecordingEngine(tiny_vlm_dir)
    policy_engine = ScriptEngine(tiny_model_dir, lambda prompt: "the POLICY answered")
    with running_gateway(tiny_vlm_dir, tmp_path / "teacher", teacher_engine) as teacher:
        upstreams = [
            UpstreamSpec("t-openai", "openai", "vlm", teacher.url + "/v1", "TEST_VLM_TEACHER_KEY"),
            UpstreamSpec("t-anthropic", "anthropic", "vlm", teacher.url, "TEST_VLM_TEACHER_KEY"),
        ]
        with running_gateway(tiny_model_dir, tmp_path / "gw", policy_engine, upstreams=upstreams) as gw:
            for n, name in enumerate(["t-openai", "t-anthropic"]):
                teacher_rollout = new_rollout(teacher)
                monkeypatch.setenv("TEST_VLM_TEACHER_KEY", teacher_rollout["api_key"])
                looked, tool_shot = png(8000 + 2 * n), png(8001 + 2 * n)
                ro = new_rollout(gw, upstream=name)
                h = OpenAIHarness(ro)
                call = {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "screenshot", "arguments": "{}"},
                }
                messages: Any = [
                    {"role": "user", "content": [h.image(looked), {"type": "text", "text": "Look."}]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {
                        "role": "tool",
                        "tool_call_id": "call_1",
                        "content": [h.image(tool_shot), {"type": "text", "text": "Here."}],
                    },
                ]
                reply = h.client().chat.completions.create(
                    model="gpt-5",
                    messages=messages,
                    tools=[{"type": "function", "function": SCREENSHOT_TOOL}],
                )
                assert reply.choices[0].message.content == ANSWER
                assert [im.data for im in teacher_engine.images[-1]] == [looked, tool_shot], name
                [seen] = calls_of(teacher, teacher_rollout["rollout_id"])
                assert seen["image_digests"] == [digest(looked), digest(tool_shot)]
                # The gateway under test records the rollout with its images, text-level.
                [recorded] = calls_of(gw, ro["rollout_id"])
                assert recorded["engine"] == f"upstream:{name[2:]}"
                assert recorded["image_digests"] == [digest(looked), digest(tool_shot)]
                r = httpx.get(f"{gw.url}/admin/images/{digest(tool_shot)}", headers=gw.admin_headers)
                assert r.content == tool_shot
        assert policy_engine.prompts == []


def test_export_sft_rows_carry_their_images(vlm: Any, tmp_path: Path) -> None:
    first, second = png(9001), png(9002)
    h = harness("openai", vlm)
    answer = h.ask([Turn("user", "What is this?", [first])])
    h.ask(
        [
            Turn("user", "What is this?", [first]),
            Turn("assistant", answer),
            Turn("user", "And this?", [second]),
        ]
    )
    rid = h.rollout["rollout_id"]
    closed = httpx.post(
        f"{vlm.url}/admin/rollouts/{rid}/close", json={"reward": 1.0}, headers=vlm.admin_headers
    )
    assert closed.status_code == 200
    out = tmp_path / "sft.jsonl"
    store = str(vlm.gateway.core.store.path)
    result = CliRunner().invoke(main, ["export-sft", "--store", store, "--out", str(out)])
    assert result.exit_code == 0, result.output
    [row] = [r for line in out.read_text().splitlines() if (r := json.loads(line))["rollout_id"] == rid]
    users = [m for m in row["messages"] if m["role"] == "user"]
    shown = []
    for m, text in zip(users, ["What is this?", "And this?"], strict=True):
        *images, last = m["content"]
        assert last == {"type": "text", "text": text} and "images" not in m
        for part in images:
            assert part["type"] == "image_url"
            head, data = part["image_url"]["url"].split(",", 1)
            assert head == "data:image/png;base64"
            shown.append(base64.b64decode(data))
    assert shown == [first, second]
    assert [m["role"] for m in row["messages"]][-2:] == ["user", "assistant"]


def test_token_counts_include_the_images(vlm: Any, text_gw: Any) -> None:
    """count_tokens (Anthropic) and countTokens (Gemini) count an image's tokens as the call will."""
    shot = png(10001, 96, 64)
    claude = harness("anthropic", vlm)
    messages: Any = [
        {"role": "user", "content": [claude.image(shot), {"type": "text", "text": "What is this?"}]}
    ]
    counted = claude.client().messages.count_tokens(model="claude-sonnet-4-5", messages=messages)  # type: ignore[attr-defined]
    claude.answer(messages)  # type: ignore[attr-defined]
    [call] = calls_of(vlm, claude.rollout["rollout_id"])
    assert counted.input_tokens == len(call["prompt_ids"])
    assert image_token_runs(vlm.engine, call["prompt_ids"]) == [
        vlm.gateway.core.renderer.processor.image_tokens(image_from_bytes(shot))
    ]
    gemini = harness("gemini", vlm)
    client = gemini.client()  # type: ignore[attr-defined]
    contents = gemini.contents([Turn("user", "What is this?", [shot])], [])  # type: ignore[attr-defined]
    total = client.models.count_tokens(model="gemini-2.5-pro", contents=contents).total_tokens
    gemini.ask([Turn("user", "What is this?", [shot])])
    [call] = calls_of(vlm, gemini.rollout["rollout_id"])
    assert total == len(call["prompt_ids"])
    # A text model counts nothing it would refuse.
    text_claude = harness("anthropic", text_gw)
    message = refusal(
        lambda: text_claude.client().messages.count_tokens(model="m", messages=messages)  # type: ignore[attr-defined]
    )
    assert "takes no images" in message


def test_a_typed_image_placeholder_is_a_400(vlm: Any) -> None:
    """The image placeholder token written in a message's text would misplace every image's pixels."""
    h = harness("openai", vlm)
    message = refusal(
        lambda: h.ask([Turn("user", "What is <|vision_start|><|image_pad|><|vision_end|>?", [png(11001)])])
    )
    assert "cannot be encoded" in message and "placeholders" in message
    assert h.ask([Turn("user", "What is this?", [png(11001)])]) == ANSWER
