"""The dialect-free heart of the gateway: rollouts, token memory, sampling, engine, recording.

A dialect translator turns a request into a `Conversation`; the gateway's route skeleton
(gateway/routes.py) prepares and runs it here (`prepare`, `run`, `release`), and the dialect turns
the `CallOutcome` back into its wire format. Nothing here knows a dialect. What a call is and how it
is recorded lives in `calls.py` (re-exported here); the open rollouts in `sessions.py`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from openforgerl.conversation import Conversation, Message, ToolCall
from openforgerl.engines.base import (
    Engine,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from openforgerl.engines.parsers import parse_completion, prompt_opens_reasoning
from openforgerl.gateway.calls import (
    CallOutcome,
    PreparedCall,
    Session,
    call_row,
    hash_key,
    injected_fault,
    message_from_record,
    recorded_message,
)
from openforgerl.gateway.errors import (
    ENGINE_UNAVAILABLE,
    GatewayError,
    bad_request,
    context_length_exceeded,
)
from openforgerl.gateway.sessions import Sessions
from openforgerl.gateway.streaming import AnswerStream, Emit, message_deltas
from openforgerl.gateway.upstream import Upstream
from openforgerl.gateway.workers import Workers
from openforgerl.rendering import ChatRenderer, PromptPlan, message_images
from openforgerl.sampling import SamplingPolicy
from openforgerl.store import CallRow, Store

__all__ = [
    "CallOutcome",
    "GatewayCore",
    "PreparedCall",
    "Session",
    "hash_key",
    "injected_fault",
    "message_from_record",
    "recorded_message",
]


def _takes(function: Any, name: str) -> bool:
    """Whether `function` takes the keyword argument `name`."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class GatewayCore:
    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        store: Store,
        *,
        policy: SamplingPolicy | None = None,
        max_context: int | None = None,
        max_inflight: int = 1024,
        upstreams: Mapping[str, Upstream] | None = None,
        workers: Workers | None = None,
    ) -> None:
        self.engine = engine
        # Engines written before streaming take no token sink (their answers stream whole at the end).
        self._engine_streams = _takes(engine.generate, "on_tokens")
        # Parsing, rendering and tokenising, off the event loop.
        self.workers = workers or Workers()
        self.upstreams = dict(upstreams or {})
        self.renderer = renderer
        self.store = store
        self.policy = policy or SamplingPolicy()
        # None: the engine's own limit (a model's max_position_embeddings), so a student made with
        # `model init --max-positions 32768` serves a harness's 15k-token prompts without a flag.
        self.max_context: int = max_context or engine.max_context or 4096
        # For the prompt-size check: read once here, not on the first request's event loop turn.
        self._chars_per_token = 2 * renderer.max_token_chars
        self.max_inflight = max_inflight
        self.inflight = 0
        self.sessions = Sessions(store, renderer, self.policy, self.upstreams)  # the open rollouts
        self._background: set[asyncio.Task[Any]] = set()
        self.counters = {
            "calls": 0,
            "extended": 0,
            "new_branch": 0,
            "aborted": 0,
            "errors": 0,
            "rejected": 0,
            "upstream_calls": 0,
            "stream_mismatches": 0,
        }

    # -- one model call -----------------------------------------------------------------
    async def prepare(self, session: Session, conv: Conversation) -> PreparedCall:
        """Everything up to the engine: checks, prompt ids (token memory, on a worker thread) and
        sampling.

        Raises GatewayError before anything was streamed, so the caller can still answer with a
        plain error status.
        """
        if session.rollout.status != "open":
            raise GatewayError(
                403, f"rollout {session.rollout.id} is {session.rollout.status}", kind="permission"
            )
        if session.faults:
            raise injected_fault(session.faults.pop(0))
        if self.inflight >= self.max_inflight:
            self.counters["rejected"] += 1
            raise GatewayError(
                429,
                f"The gateway is at its limit of {self.max_inflight} calls in flight; retry shortly.",
                kind="rate_limit",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        self._check_prompt_size(session, conv)
        self.inflight += 1  # counted from here so a burst cannot slip past the limit
        try:
            return await self._prepare(session, conv)
        except BaseException:
            self.inflight -= 1
            raise

    async def _prepare(self, session: Session, conv: Conversation) -> PreparedCall:
        plan = await self.workers.run(self._plan, session, conv, share=session.rollout.id)
        params: SamplingParams | None = None
        body: dict[str, Any] | None = None
        if session.upstream:
            # Input the upstream's API cannot take is refused here, before anything was streamed.
            body, used = self._upstream(session).request(conv, session.rollout.sampling, session.next_seq)
        else:
            prompt_tokens = len(plan.prompt_ids)
            engine_max = min(self.max_context, self.engine.max_context or self.max_context)
            try:
                params, used = session.policy.resolve(
                    conv.sampling,
                    prompt_tokens,
                    engine_max,
                    self.renderer.stop_token_ids,
                    # "text" asks for nothing; a JSON object or schema is constrained where possible.
                    conv.response_format if (conv.response_format or {}).get("type") != "text" else None,
                    self.engine.supports_response_format,
                    call=session.next_seq,
                )
            except ValueError as exc:
                raise context_length_exceeded(prompt_tokens, int(exc.args[0])) from exc
        seq = session.next_seq
        session.next_seq += 1
        return PreparedCall(
            session, conv, plan, params, used, seq, time.time(), upstream_body=body, images=list(plan.images)
        )

    def images_refused(self, session: Session, shown: int | None = None) -> GatewayError | None:
        """The 400 for images this rollout's model cannot take (None when it takes them); without a
        count, the one error every request of a text model carries to its parse (made once)."""
        if session.upstream or self.renderer.takes_images:
            return None
        return self._no_images if shown is None else self._images_error(str(shown))

    @functools.cached_property
    def _no_images(self) -> GatewayError:
        return self._images_error("images")

    def _images_error(self, many: str) -> GatewayError:
        return GatewayError(
            400,
            f"The policy model {self.model_name} takes no images (it reads text only), and this "
            f"request shows {many}. Send text only, or serve a vision-language model.",
            kind="invalid_request",
            code="images_not_supported",
            param="messages",
        )

    def _check_prompt_size(self, session: Session, conv: Conversation) -> None:
        """A 400 for a prompt certainly too long for the policy's context, before it is rendered or
        tokenised (for a call or a count alike); an upstream's context is its own.

        No token covers more than `renderer.max_token_chars` characters, so a prompt whose messages
        hold more than that many times the context in characters (doubled, for normalisers that
        fold characters) cannot fit: answering that takes a sum instead of seconds of tokenising.
        """
        if session.upstream:
            return
        chars = sum(len(m.content) for m in conv.messages)
        if chars > self.max_context * self._chars_per_token:
            raise context_length_exceeded(chars // self._chars_per_token, self.max_context)

    def _plan(self, session: Session, conv: Conversation) -> PromptPlan:
        """Token memory's plan for the call; a 400 for images the policy cannot take."""
        shown = message_images(conv.messages)
        if shown and (refused := self.images_refused(session, len(shown))) is not None:
            raise refused
        try:
            return session.memory.plan(conv.messages, conv.tools)
        except ValueError as exc:  # e.g. an image placeholder token typed into a message's text
            raise bad_request(f"The prompt cannot be encoded for the policy model: {exc}") from exc

    @property
    def model_name(self) -> str:
        """The policy model's name for messages: its directory's name (the gateway's --model)."""
        path = str(getattr(getattr(self.renderer, "tokenizer", None), "name_or_path", "") or "")
        return path.rstrip("/").rsplit("/", 1)[-1] or "policy"

    def _upstream(self, session: Session) -> Upstream:
        upstream = self.upstreams.get(session.upstream)
        if upstream is None:
            raise GatewayError(
                500,
                f"Rollout {session.rollout.id} is answered by upstream '{session.upstream}', which this "
                "gateway was not started with (--upstream).",
                kind="internal",
            )
        return upstream

    def release(self, call: PreparedCall) -> None:
        """End a call's slot in flight (idempotent: also for a call that never ran)."""
        if not call.released:
            call.released = True
            self.inflight -= 1

    async def count_tokens(self, session: Session, conv: Conversation) -> int:
        self._check_prompt_size(session, conv)
        return await self.workers.run(self._count_tokens, session, conv, share=session.rollout.id)

    def _count_tokens(self, session: Session, conv: Conversation) -> int:
        """The prompt length this conversation would have (token memory included), without a call.
        For an upstream's rollout: an estimate, in the policy's tokenizer."""
        if session.upstream:
            messages, images = conv.messages, message_images(conv.messages)
            if not self.renderer.takes_images:  # the estimate counts the text only
                messages, images = [replace(m, images=[]) for m in messages], []
            return len(self.renderer.encode(self.renderer.render(messages, conv.tools), images))
        return len(self._plan(session, conv).prompt_ids)

    async def complete(self, session: Session, conv: Conversation) -> CallOutcome:
        return await self.run(await self.prepare(session, conv))

    async def run(self, call: PreparedCall, on_delta: Emit | None = None) -> CallOutcome:
        """Generate, parse, record durably, and only then return (the harness's acknowledgement).

        `on_delta` (a streamed answer) gets the answer's pieces as the engine samples them, and all
        of it before this returns: the pieces reassemble into the outcome's message."""
        try:
            if call.session.upstream:
                return await self._run_upstream(call, on_delta)
            return await self._run(call, on_delta)
        finally:
            self.release(call)

    async def _run(self, call: PreparedCall, on_delta: Emit | None) -> CallOutcome:
        plan = call.plan
        assert call.params is not None
        # A template that opens `<think>` itself leaves the completion inside the reasoning.
        in_reasoning = prompt_opens_reasoning(plan.prompt_text[-64:])  # the rendered prompt's end
        stream = None
        if on_delta is not None:
            stop_ids = self.renderer.stop_token_ids
            stream = AnswerStream(
                self.renderer.decode, stop_ids, call.params.stop, on_delta, in_reasoning=in_reasoning
            )

        def record(
            status: str, error: str, result: GenerateResult | None, message: Message | None
        ) -> CallRow:
            row = call_row(call, self.engine.name, status, error, message)
            if result is not None:
                row.policy_version = result.policy_version
                row.completion_ids = result.completion_ids
                row.completion_logprobs = result.logprobs
                row.finish_reason = result.finish_reason
                row.stop_reason = None if result.stop_reason is None else str(result.stop_reason)
            return row

        # Engines written before images (or streaming) take two arguments: only what is used is passed.
        extra: dict[str, Any] = {"images": call.images} if call.images else {}
        if stream is not None and self._engine_streams:
            extra["on_tokens"] = stream.tokens
        try:
            result = await self.engine.generate(plan.prompt_ids, call.params, **extra)
        except asyncio.CancelledError:
            # The client went away and the engine aborted: keep a record that says so.
            self.counters["aborted"] += 1
            self._in_background(
                self._record_failure(call, record("aborted", "client disconnected", None, None))
            )
            raise
        except EngineOverloaded as exc:
            self.counters["rejected"] += 1
            raise GatewayError(
                429, str(exc), kind="rate_limit", code="engine_overloaded", retry_after=exc.retry_after
            ) from exc
        except EngineUnavailable as exc:
            self.counters["errors"] += 1
            await self._record_failure(call, record("error", f"{ENGINE_UNAVAILABLE}: {exc}", None, None))
            raise GatewayError(
                503,
                f"The inference engine is unavailable: {exc}",
                kind="unavailable",
                retry_after=exc.retry_after,
            ) from exc
        except EngineError as exc:
            self.counters["errors"] += 1
            await self._record_failure(call, record("error", f"engine error: {exc}", None, None))
            raise GatewayError(500, f"The inference engine failed: {exc}", kind="internal") from exc

        message, finish, errors, turn_end = self._to_message(result, call.params.stop, in_reasoning)
        if stream is not None:
            stream.finish(message)
            self.counters["stream_mismatches"] += stream.mismatches
        row = record("ok", "", result, message)
        row.parse_errors = errors
        call_id = await self._record_ok(call, row, result.completion_ids, message, turn_end)
        return CallOutcome(
            call_id=call_id,
            message=message,
            finish_reason=finish,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(result.completion_ids),
            cached_tokens=plan.prefix_len,
            policy_version=result.policy_version,
            prompt_ids=plan.prompt_ids,
            completion_ids=result.completion_ids,
            logprobs=result.logprobs,
            parse_errors=errors,
            stop_reason=result.stop_reason,
        )

    async def _run_upstream(self, call: PreparedCall, on_delta: Emit | None) -> CallOutcome:
        """The call sent to the rollout's upstream; recorded at text level (no ids, no logprobs)."""
        session = call.session
        upstream = self._upstream(session)
        assert call.upstream_body is not None

        def record(status: str, error: str, message: Message | None, model: str) -> CallRow:
            row = call_row(call, self.engine.name, status, error, message)
            row.engine, row.model = upstream.engine_name, model
            row.sampling_requested["model"] = call.conv.model  # the name the harness asked for
            return row

        try:
            reply = await upstream.send(call.upstream_body)
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            row = record("aborted", "client disconnected", None, upstream.spec.model)
            self._in_background(self._record_failure(call, row))
            raise
        except GatewayError as err:
            self.counters["errors"] += 1
            row = record("error", f"upstream {err.status}: {err.message}", None, upstream.spec.model)
            await self._record_failure(call, row)
            raise
        if on_delta is not None:  # an upstream answers whole
            for delta in message_deltas(reply.message):
                on_delta(delta)
        row = record("ok", "", reply.message, reply.model)
        row.finish_reason, row.stop_reason = reply.finish_reason, reply.stop_reason
        row.sampling_used = {
            **call.used,
            "usage": {
                "prompt_tokens": reply.prompt_tokens,
                "completion_tokens": reply.completion_tokens,
                "cached_tokens": reply.cached_tokens,
            },
        }
        call_id = await self._record_ok(call, row, [], reply.message, True)
        self.counters["upstream_calls"] += 1
        return CallOutcome(
            call_id=call_id,
            message=reply.message,
            finish_reason=reply.finish_reason,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            cached_tokens=reply.cached_tokens,
            policy_version=-1,
            prompt_ids=[],
            completion_ids=[],
            logprobs=[],
            stop_reason=reply.stop_reason,
        )

    async def _record_ok(
        self,
        call: PreparedCall,
        row: CallRow,
        completion_ids: list[int],
        message: Message,
        turn_end: bool,
    ) -> int:
        # The branch is decided at commit time (two calls racing from one tip: the first extends
        # the branch, the second forks). The tip needs the call id, which the store assigns; the
        # tip carries a provisional id until the insert returns. No later call can extend the tip
        # before then: a harness only sees this answer after the insert.
        session, plan = call.session, call.plan
        provisional = -(row.seq + 1)
        commit = session.memory.commit(plan, provisional, completion_ids, message, turn_end)
        row.branch_id = commit.branch_id
        row.parent_call_id = commit.parent_call_id
        row.branch_reason = commit.reason
        row.memory = commit.tip.memory_record()
        row.response_id, row.response_context = call.response_id, call.response_context
        try:
            call_id = await self.store.record_call(row, call.images)
        except BaseException:
            if commit.tip in session.memory.tips:
                session.memory.tips.remove(commit.tip)
            raise
        commit.tip.call_id = call_id
        self.counters["calls"] += 1
        self.counters[
            "extended" if row.parent_call_id is not None and not row.branch_reason else "new_branch"
        ] += 1
        return call_id

    async def _record_failure(self, call: PreparedCall, row: CallRow) -> None:
        row.branch_id = call.session.memory.next_branch_id
        row.parent_call_id = None
        await self.store.record_call(row, call.images)

    def _in_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _to_message(
        self, result: GenerateResult, stop: tuple[str, ...], in_reasoning: bool = False
    ) -> tuple[Message, str, list[str], bool]:
        """Sampled ids -> the assistant message a harness sees, the finish reason and parse errors."""
        ids = result.completion_ids
        ended = bool(ids) and ids[-1] in self.renderer.stop_token_ids and result.finish_reason == "stop"
        text = self.renderer.decode(ids[:-1] if ended else ids)
        # Only the template's own turn end closes the turn in the token memory; a turn that ended on
        # another stop id (SmolLM2's <|endoftext|>) is closed by the next prompt, as a cut one is.
        turn_end = ended and ids[-1] == self.renderer.turn_end_id
        if (
            result.finish_reason == "stop"
            and isinstance(result.stop_reason, str)
            and result.stop_reason in stop
        ):
            # OpenAI semantics: the stop string is not part of the returned text (it stays in the ids).
            cut = text.rfind(result.stop_reason)
            if cut >= 0:
                text = text[:cut]
        parsed = parse_completion(text, in_reasoning=in_reasoning)
        message = Message(
            role="assistant",
            content=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=[
                ToolCall(c.name, c.arguments, c.id or f"call_{secrets.token_hex(12)}")
                for c in parsed.tool_calls
            ],
        )
        finish: str = result.finish_reason
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        return message, finish, parsed.errors, turn_end

    async def load_weights(self, path: str) -> int:
        return await self.engine.load_weights(path)

    def stats(self) -> dict[str, Any]:
        return {
            "inflight": self.inflight,
            "open_sessions": len(self.sessions),
            "policy_version": self.engine.policy_version,
            "upstreams": sorted(self.upstreams),
            **self.counters,
        }
