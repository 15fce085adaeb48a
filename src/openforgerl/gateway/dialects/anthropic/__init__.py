"""Anthropic Messages (Claude Code, pi): wire models, and the translation to and from a `Conversation`.

Choices the wire format leaves open, and why:

- Text blocks of one message (system, user, tool result) are joined with a newline, so a string and
  a list with one text block become the same `Message`. Claude Code moves `cache_control` to the
  newest block every turn, flipping that message between the two forms; token memory never notices.
- The `system` prompt is kept as sent, Claude Code's `x-anthropic-billing-header` block included:
  it is constant within a session (so token memory loses nothing) and it is what the policy will
  see when deployed behind Claude Code.
- A `tool_result` with `is_error: true` becomes a tool message starting "Error: ", so the model sees
  the failure the harness reported. Several tool results in one user turn become several tool
  messages; text beside them becomes a user message, in the order sent.
- `thinking` blocks are the assistant's reasoning; `redacted_thinking` is dropped (encrypted, nothing
  a model can read). `thinking.display == "omitted"` (Claude Code) is honoured: the block comes back
  with its signature but without its text; the record keeps every sampled token regardless.
- Images (in user turns and inside `tool_result`s) come in as base64 or as a `file` source naming
  an image uploaded to the gateway (`POST /v1/files`); a `url` source gets a 400, since the gateway
  fetches nothing (the record must hold the pixels). A message's images come before its text.
  Documents get a 400. So do server tools (a `type` other than "custom", e.g.
  `web_search_20250305`): nobody here runs them, and a model answering a search that never ran
  would fabricate the results. `defer_loading` is ignored: with no tool search, a
  deferred tool is listed like any other. A final assistant message (prefill) gets a 400: the chat
  template always opens a new turn.
- `usage.input_tokens` counts the prompt tokens not reused from token memory and
  `cache_read_input_tokens` the reused ones; their sum is the prompt length, as in Anthropic's API
  (Claude Code adds them up to decide when to compact).
- An engine that is down stays the core's 503, typed `api_error`; a 529 (injected faults) is an
  `overloaded_error`. Claude Code 2.1.332 retried five 503s in a row as it did five 529s, but it
  treats overload specially (`--fallback-model` switches models on it). After a stream has begun
  the status is spent, so engine trouble is an `overloaded_error` event, as Anthropic sends it.

Its parts: the wire format and the error body (`protocol.py`), a request as a `Conversation`
(`parsing.py`), an answer as a message or its events (`answers.py`), the routes (`dialect.py`).
"""

from openforgerl.gateway.dialects.anthropic.answers import MessagesExchange
from openforgerl.gateway.dialects.anthropic.dialect import AnthropicMessages
from openforgerl.gateway.dialects.anthropic.parsing import parse_request
from openforgerl.gateway.dialects.anthropic.protocol import NAME, MessagesRequest, error_body, stream_error

__all__ = [
    "NAME",
    "AnthropicMessages",
    "MessagesExchange",
    "MessagesRequest",
    "error_body",
    "parse_request",
    "stream_error",
]
