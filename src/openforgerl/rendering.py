"""Conversation -> prompt ids with the model's own chat template, and the token memory.

The token memory is what keeps the recorded sequence equal to what the policy sampled. Harnesses
echo the model's turns back re-serialised (compact JSON, rewritten call ids, reasoning dropped),
so re-tokenising the echoed text would drift from the sampled ids. Instead each rollout keeps the
tips of its branches: the canonical keys of the messages seen so far and the exact ids of prompt +
completion. A request whose messages extend a tip gets `tip ids + ids of the new messages only`:
the history is never re-tokenised, so the recorded sequence is exact and the tokenising work grows
with the new tokens. A request that does not extend any tip starts a new branch, with the reason.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from openforgerl.conversation import Message, Tool
from openforgerl.images import Image
from openforgerl.jsonutil import dumps, loads

MAX_TIPS = 8  # tips kept per rollout: enough for retries and side requests, bounded memory


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def canonical_arguments(arguments: dict[str, Any] | str) -> Any:
    """Tool-call arguments compared by meaning: '{"a": 1}' equals '{"a":1}' equals {"a": 1}."""
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments)
        except ValueError:
            return arguments
    return orjson.loads(dumps(arguments, sort_keys=True))


def message_key(m: Message) -> bytes:
    """A message's identity for token memory.

    Ignored on purpose, because harnesses change them when they echo a turn back: tool-call ids,
    the assistant's reasoning (most clients drop it) and whitespace around assistant text. Images
    count by digest: the same text with another screenshot is another message.
    """
    payload: Any
    if m.role == "assistant":
        payload = ("a", m.content.strip(), [(c.name, canonical_arguments(c.arguments)) for c in m.tool_calls])
    elif m.role == "tool":
        payload = ("t", m.content)
    else:
        payload = (m.role, m.content, m.name)
    if m.images:
        payload = (payload, [im.digest for im in m.images])
    return _digest(dumps(payload, sort_keys=True))


def tools_key(tools: Sequence[Tool]) -> bytes:
    return _digest(dumps([t.template_dict() for t in tools], sort_keys=True))


def message_images(messages: Sequence[Message]) -> list[Image]:
    """Every image of `messages`, in prompt order (a message's images come before its text)."""
    return [im for m in messages for im in m.images]


class ChatRenderer:
    """The model's chat template and tokenizer, used the way the gateway needs them."""

    takes_images = False

    def __init__(self, tokenizer: Any, turn_end: str | None = None, end_ids: Sequence[int] = ()) -> None:
        """`end_ids`: more ids that end a turn, e.g. the model's generation config's eos ids (the
        engine stops on them, so a turn may end with one)."""
        self.tokenizer = tokenizer
        # The fast tokenizer's Rust backend: encoding through it skips Python-side overhead.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.turn_end: str = turn_end or tokenizer.eos_token
        if not self.turn_end:
            raise ValueError("the tokenizer has no eos token; pass turn_end (the text that ends a turn)")
        self.turn_end_id: int = tokenizer.convert_tokens_to_ids(self.turn_end)
        stop = {self.turn_end_id}
        for tok in (
            tokenizer.eos_token,
            tokenizer.pad_token if tokenizer.pad_token == "<|endoftext|>" else None,
        ):
            if tok:
                stop.add(tokenizer.convert_tokens_to_ids(tok))
        stop.update(end_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stop))

    def render(self, messages: Sequence[Message], tools: Sequence[Tool]) -> str:
        text = self.tokenizer.apply_chat_template(
            [m.template_dict() for m in messages],
            tools=[t.template_dict() for t in tools] or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str, images: Sequence[Image] = ()) -> list[int]:
        if images:
            raise ValueError("this model takes no images")
        return self._encode_text(text)

    def _encode_text(self, text: str) -> list[int]:
        if self._backend is not None:
            # encode_batch, not encode: only the batch call releases the GIL while it works, so the
            # gateway's event loop keeps running while a worker thread tokenises a long prompt
            # (measured on a 10 MB prompt: the loop stalled 11.4 s with encode, 0.28 s with this).
            return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary string's length (a byte-level
        token's string has a character per byte, at least one byte per decoded character)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


class VisionRenderer(ChatRenderer):
    """A vision-language model's renderer: the chat template renders one placeholder per image
    (e.g. <|vision_start|><|image_pad|><|vision_end|>), and `encode` repeats each image's pad token
    as many times as the image has tokens (from its size, as the processor resizes it), so prompt
    ids are what the model takes with the images' pixels. `processor` is an
    `openforgerl.vision.VisionProcessor`."""

    takes_images = True

    def __init__(self, processor: Any, turn_end: str | None = None, end_ids: Sequence[int] = ()) -> None:
        super().__init__(processor.tokenizer, turn_end, end_ids)
        self.processor = processor
        self.image_token_id: int = processor.image_token_id

    def encode(self, text: str, images: Sequence[Image] = ()) -> list[int]:
        ids = self._encode_text(text)
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(
                f"the rendered prompt has {len(at)} image placeholders for {len(images)} images "
                f"(is {self.processor.image_token} written in a message's text?)"
            )
        if not images:
            return ids
        out: list[int] = []
        start = 0
        for i, image in zip(at, images, strict=True):
            out += ids[start:i]
            out += [self.image_token_id] * self.processor.image_tokens(image)
            start = i + 1
        out += ids[start:]
        return out


def renderer_for(model: str | Path | Any) -> ChatRenderer:
    """The renderer of a model directory (a VisionRenderer when it holds a vision-language model) or
    of a tokenizer object (a ChatRenderer)."""
    if isinstance(model, str | Path):
        from openforgerl.vision import is_vision_model, load_processor

        end_ids = generation_eos_ids(model)
        if is_vision_model(model):
            return VisionRenderer(load_processor(model), end_ids=end_ids)
        from transformers import AutoTokenizer

        return ChatRenderer(AutoTokenizer.from_pretrained(model), end_ids=end_ids)
    return ChatRenderer(model)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The eos ids of the model's generation config (SmolLM2's: <|im_end|> and <|endoftext|>)."""
    from transformers import GenerationConfig

    try:
        eos: Any = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        return ()
    if eos is None:
        return ()
    return tuple([eos] if isinstance(eos, int) else eos)


@dataclass(slots=True)
class Tip:
    """The end of a branch: everything needed to extend it without re-tokenising.

    Its ids (prompt + completion) are the first `length` of `buffer`, int32s that the tips of one
    branch share: a call that extends the branch appends to its parent's buffer, so a rollout holds
    each token once (4 bytes) instead of a list of Python ints per call."""

    call_id: int
    branch_id: int
    keys: list[bytes]
    tools_key: bytes
    buffer: array[int]
    length: int
    prompt_text_len: int
    prompt_text_hash: bytes
    ended_with_turn_end: bool
    extended: bool = False

    @property
    def ids(self) -> list[int]:
        return self.buffer[: self.length].tolist()

    def extended_by(self, ids: Sequence[int]) -> tuple[array[int], int]:
        """(buffer, length) of `ids`, which continue this tip (a plan built them from it): this tip's
        buffer, appended to, unless another call already appended to it (a fork gets its own)."""
        if len(self.buffer) == self.length:
            self.buffer.extend(ids[self.length :])
            return self.buffer, len(ids)
        return array("i", ids), len(ids)

    def memory_record(self) -> dict[str, Any]:
        """What the store keeps so a restarted gateway can rebuild this tip."""
        return {
            "keys": [k.hex() for k in self.keys],
            "tools_key": self.tools_key.hex(),
            "prompt_text_len": self.prompt_text_len,
            "prompt_text_hash": self.prompt_text_hash.hex(),
            "ended_with_turn_end": self.ended_with_turn_end,
        }


@dataclass(slots=True)
class PromptPlan:
    prompt_ids: list[int]
    prompt_text: str
    keys: list[bytes]
    tools_key: bytes
    parent: Tip | None
    prefix_len: int  # ids taken from the parent tip (its prompt + completion)
    first_new_message: int  # index of the first message the parent had not seen
    miss_reason: str  # why no tip was extended ('' when one was)
    images: list[Image] = field(default_factory=list)  # every image of the full prompt, in order


@dataclass(slots=True)
class Commit:
    branch_id: int
    parent_call_id: int | None
    reason: str  # why a new branch started ('' when the call extended its branch)
    tip: Tip


@dataclass
class TokenMemory:
    """The branches of one rollout."""

    renderer: ChatRenderer
    tips: list[Tip] = field(default_factory=list)
    next_branch_id: int = 0

    def longest_tip(self, keys: list[bytes], tkey: bytes) -> Tip | None:
        """The tip with the same tools whose messages are the longest proper prefix of `keys`."""
        best: Tip | None = None
        for tip in list(self.tips):  # a copy: plans run on worker threads while calls commit
            n = len(tip.keys)
            if (
                n < len(keys)
                and tip.tools_key == tkey
                and (best is None or n > len(best.keys))
                and keys[:n] == tip.keys
            ):
                best = tip
        return best

    def plan(self, messages: Sequence[Message], tools: Sequence[Tool]) -> PromptPlan:
        keys = [message_key(m) for m in messages]
        tkey = tools_key(tools)
        text = self.renderer.render(messages, tools)
        images = message_images(messages)
        best = self.longest_tip(keys, tkey)
        reason = ""
        if best is not None:
            plen = best.prompt_text_len
            if len(text) < plen or _digest(text[:plen].encode()) != best.prompt_text_hash:
                reason = "the chat template rendered the earlier conversation differently"
            else:
                end = text.find(self.renderer.turn_end, plen)
                if end < 0:
                    reason = "the echoed assistant turn has no turn end in the rendered prompt"
                else:
                    # A completion cut by max_tokens never sampled the turn end: the template closes
                    # the turn, so the prompt does too (as a prompt token, not a sampled one).
                    closing = [] if best.ended_with_turn_end else [self.renderer.turn_end_id]
                    # The delta text renders exactly the new messages, so it holds their images only.
                    new_images = message_images(messages[len(best.keys) :])
                    delta = closing + self.renderer.encode(
                        text[end + len(self.renderer.turn_end) :], new_images
                    )
                    return PromptPlan(
                        prompt_ids=best.ids + delta,
                        prompt_text=text,
                        keys=keys,
                        tools_key=tkey,
                        parent=best,
                        prefix_len=best.length,
                        first_new_message=len(best.keys),
                        miss_reason="",
                        images=images,
                    )
        else:
            reason = self._explain_miss(keys, tkey)
        return PromptPlan(
            prompt_ids=self.renderer.encode(text, images),
            prompt_text=text,
            keys=keys,
            tools_key=tkey,
            parent=None,
            prefix_len=0,
            first_new_message=0,
            miss_reason=reason,
            images=images,
        )

    def _explain_miss(self, keys: list[bytes], tkey: bytes) -> str:
        if not self.tips:
            return "first call of the rollout"
        closest = max(self.tips, key=lambda t: _common_prefix(t.keys, keys))
        common = _common_prefix(closest.keys, keys)
        if common == len(closest.keys) == len(keys):
            return "the request repeats an answered conversation without a new message"
        if common == len(closest.keys):
            return "the tools changed"
        if common == len(keys):
            return f"the conversation is shorter than the branch: it ends at message {common}"
        return f"message {common} differs from the recorded conversation (history rewritten)"

    def commit(
        self,
        plan: PromptPlan,
        call_id: int,
        completion_ids: Sequence[int],
        generated: Message,
        turn_end: bool,
    ) -> Commit:
        """Record a finished call as a new tip; extend the parent's branch or start a new one."""
        parent = plan.parent
        reason = plan.miss_reason
        if parent is not None and not parent.extended:
            branch_id = parent.branch_id
            parent.extended = True
        else:
            if parent is not None:
                reason = f"fork: call {parent.call_id} was already extended by another call"
            branch_id = self.next_branch_id
        self.next_branch_id = max(self.next_branch_id, branch_id + 1)
        ids = plan.prompt_ids + list(completion_ids)
        buffer, length = parent.extended_by(ids) if parent is not None else (array("i", ids), len(ids))
        tip = Tip(
            call_id=call_id,
            branch_id=branch_id,
            keys=[*plan.keys, message_key(generated)],
            tools_key=plan.tools_key,
            buffer=buffer,
            length=length,
            prompt_text_len=len(plan.prompt_text),
            prompt_text_hash=_digest(plan.prompt_text.encode()),
            ended_with_turn_end=turn_end,
        )
        self.tips.append(tip)
        if len(self.tips) > MAX_TIPS:
            del self.tips[0]
        return Commit(branch_id, parent.call_id if parent is not None else None, reason, tip)

    def restore(self, call_id: int, branch_id: int, memory: dict[str, Any], ids: list[int]) -> None:
        """Rebuild a tip from the store (after a restart)."""
        self.tips.append(
            Tip(
                call_id=call_id,
                branch_id=branch_id,
                keys=[bytes.fromhex(k) for k in memory["keys"]],
                tools_key=bytes.fromhex(memory["tools_key"]),
                buffer=array("i", ids),
                length=len(ids),
                prompt_text_len=memory["prompt_text_len"],
                prompt_text_hash=bytes.fromhex(memory["prompt_text_hash"]),
                ended_with_turn_end=memory["ended_with_turn_end"],
            )
        )
        if len(self.tips) > MAX_TIPS:
            del self.tips[0]
        self.next_branch_id = max(self.next_branch_id, branch_id + 1)


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
