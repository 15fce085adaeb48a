"""OpenAI Responses: `POST /v1/responses` (JSON or SSE) and the WebSocket transport on `GET /v1/responses`.

Request -> `Conversation`:
- `input` items: messages (user/system/developer/assistant), `function_call`, `function_call_output`
  and `reasoning` (its text becomes the assistant turn's reasoning). The assistant-side items of one
  answer (reasoning, message, function calls) merge into one assistant message, so an echoed answer
  matches the token memory's record of it. `instructions` become a leading system message.
- tools: `function` tools as they are; the functions inside a `namespace` tool are flattened to
  `<namespace>__<name>` (just `<namespace><name>` when the namespace already ends in `__` or `/`, as
  Codex names them itself), and calls of those come back as `name` + `namespace`. Hosted and custom
  tools (web_search, file_search, custom, ...) are not served: the model never sees them (logged once
  per type), and they are not an error, since Codex always sends web_search.
- `text.format` becomes `Conversation.response_format` in the Chat Completions shape.
- Images: `input_image` parts with an `image_url` (a data URL) or a `file_id` (an image uploaded to
  the gateway, `POST /v1/files`), in messages and in a `function_call_output` given as a list of
  parts (a tool's screenshot). A message's images come before its text.

State: clients send `store: false` yet chain requests with `previous_response_id` + only the new
items (Codex over WebSocket always does). The gateway remembers, per rollout, in memory and bounded,
each response's conversation (instructions, messages including its output, tools), and expands such a
request to the full conversation before it reaches the core. A request without `instructions` or
`tools` inherits those of the previous response. A response that memory has lost (a restarted gateway,
or one forgotten for newer ones) is rebuilt from the store, scoped to the rollout: its call's record
and the records of the calls its prompt extends hold the conversation (each holds the messages its
parent had not seen, and its answer), and the call keeps, in its transaction, the response id, whether
the conversation starts with the instructions, and the tools as the Response lists them (once per
branch, and again when they change). A prewarm (`generate: false`) makes no call: its context lives
in memory only.

WebSocket (Codex's built-in provider; `openai-beta: responses_websockets=...`): the key is checked on
the handshake like on HTTP (401 in the Responses error shape otherwise). Each text frame
`{"type": "response.create", ...body...}` is answered with the same events as the SSE stream, one
JSON text frame each; `generate: false` answers at once with an empty completed response whose
context is remembered (Codex's prewarm); `response.processed` frames need no answer; failures before
generation are `{"type": "error", "status", "error": {...}, "headers"}` frames, after it
`response.failed`, and the connection stays open.

Its parts: the wire format (`protocol.py`), the request's parts in the gateway's terms (`parsing.py`),
chaining state (`chaining.py`), a response's events (`events.py`), the routes and the WebSocket
transport (`dialect.py`).
"""

from openforgerl.gateway.dialects.responses.chaining import (
    CONTEXTS_PER_ROLLOUT,
    ROLLOUTS_REMEMBERED,
    Context,
    Contexts,
    Turn,
    parse_turn,
    rebuilt_context,
)
from openforgerl.gateway.dialects.responses.dialect import OpenAIResponses
from openforgerl.gateway.dialects.responses.events import Reply, sse, ws_error
from openforgerl.gateway.dialects.responses.parsing import ToolSet, flat_name, input_messages, tool_set
from openforgerl.gateway.dialects.responses.protocol import NAME, ResponsesRequest

__all__ = [
    "CONTEXTS_PER_ROLLOUT",
    "NAME",
    "ROLLOUTS_REMEMBERED",
    "Context",
    "Contexts",
    "OpenAIResponses",
    "Reply",
    "ResponsesRequest",
    "ToolSet",
    "Turn",
    "flat_name",
    "input_messages",
    "parse_turn",
    "rebuilt_context",
    "sse",
    "tool_set",
    "ws_error",
]
