"""The gateway's HTTP surface: the admin API, each dialect's routes, and image uploads (Starlette, ASGI).

Uploads (`POST /v1/files`, the OpenAI Files API; Anthropic's SDK uploads to the same path and gets
its own shape) take images only: each is kept in the store by digest, and its file id is derived
from the digest, so messages of any dialect can name it (`file_id`, Anthropic's `file` source,
Gemini's `fileData`) and a restarted gateway still knows it. An upload needs a rollout's key, and
is visible to that rollout only: another rollout's key gets a 404 for its id, as for an unknown one.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from email import policy
from email.parser import BytesParser
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from openforgerl import jsonutil
from openforgerl.engines.base import EngineError, EngineUnavailable
from openforgerl.gateway.core import GatewayCore, Session
from openforgerl.gateway.dialects.anthropic import AnthropicMessages
from openforgerl.gateway.dialects.gemini import Gemini
from openforgerl.gateway.dialects.openai_chat import OpenAIChat
from openforgerl.gateway.dialects.responses import OpenAIResponses
from openforgerl.gateway.errors import GatewayError, bad_request, load_image, unauthorized
from openforgerl.gateway.http import JSONResponse, api_key_of, read_body
from openforgerl.gateway.routes import Routes
from openforgerl.gateway.serving import Dialect
from openforgerl.images import Image, digest_of_file_id, file_id, image_from_bytes
from openforgerl.store import public_calls


def default_dialects() -> list[Dialect]:
    """Every dialect; the first answers errors on the paths no other one owns."""
    return [OpenAIChat(), OpenAIResponses(), Gemini(), AnthropicMessages()]


class Gateway:
    """Builds the Starlette app around a GatewayCore."""

    def __init__(
        self,
        core: GatewayCore,
        *,
        admin_token: str,
        public_url: str,
        max_body: int = 32 << 20,
        dialects: Sequence[Dialect] | None = None,
    ) -> None:
        self.core = core
        # The first dialect also answers errors on paths no dialect owns.
        self.dialects: list[Dialect] = list(dialects) if dialects is not None else default_dialects()
        self.admin_token = admin_token
        self.public_url = public_url.rstrip("/")
        self.max_body = max_body
        # Each dialect's routes, answered by one skeleton.
        self.dialect_routes = Routes(core, max_body)

    def _check_admin(self, request: Request) -> None:
        # Never from the URL: query strings end up in access logs and proxies' records.
        key = api_key_of(request, in_query=False) or ""
        if not hmac.compare_digest(key.encode(), self.admin_token.encode()):
            raise unauthorized("This endpoint needs the gateway's admin token.")

    def dialect_for(self, path: str) -> Dialect:
        for dialect in self.dialects[1:]:
            if dialect.owns_path(path):
                return dialect
        return self.dialects[0]  # the fallback owns everything the others don't

    def error(self, err: GatewayError, request: Request) -> Response:
        """An error in the dialect of the path it answers."""
        return self.dialect_for(request.url.path).error_response(err)

    async def not_found(self, request: Request) -> Response:
        message = f"Unknown endpoint {request.method} {request.url.path}."
        return self.error(GatewayError(404, message, kind="not_found"), request)

    # -- admin API ------------------------------------------------------------------------
    async def admin(self, request: Request) -> Response:
        """Dispatch of every /admin route: one error shape (OpenAI's) for all of them."""
        try:
            self._check_admin(request)
            handler = getattr(self, "admin_" + request.scope["route_name"])
            return await handler(request)
        except GatewayError as err:
            return self.error(err, request)

    async def _json_body(self, request: Request) -> dict[str, Any]:
        body = await read_body(request, self.max_body)
        if not body.strip():
            return {}
        try:
            data = jsonutil.loads(body)
        except jsonutil.TooDeep as exc:
            raise bad_request(f"The request body cannot be read: {exc}.") from exc
        except ValueError as exc:
            raise bad_request(f"The request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise bad_request("The request body must be a JSON object.")
        return data

    async def admin_create_rollout(self, request: Request) -> Response:
        data = await self._json_body(request)
        for name in ("run_id", "task_id", "upstream"):
            if not isinstance(data.get(name, ""), str):
                raise bad_request(f"'{name}' must be a string.", param=name)
        for name in ("metadata", "sampling"):
            if not isinstance(data.get(name, {}), dict):
                raise bad_request(f"'{name}' must be an object.", param=name)
        session, api_key = await self.core.sessions.create(
            run_id=data.get("run_id", ""),
            task_id=data.get("task_id", ""),
            metadata=data.get("metadata"),
            sampling=data.get("sampling"),
            # A name from the gateway's own --upstream list: keys never travel through this API.
            upstream=data.get("upstream", ""),
        )
        return JSONResponse(
            {
                **session.rollout.public(),
                "api_key": api_key,
                "base_url": f"{self.public_url}/r/{session.rollout.id}",
            },
            status_code=201,
        )

    async def admin_list_rollouts(self, request: Request) -> Response:
        q = request.query_params
        try:
            limit = int(q.get("limit", "100"))
            offset = int(q.get("offset", "0"))
        except ValueError as exc:
            raise bad_request("'limit' and 'offset' must be integers.") from exc
        if not (1 <= limit <= 10000) or not (0 <= offset < 2**63):  # SQLite's integers are 64-bit
            raise bad_request("'limit' must be in [1, 10000] and 'offset' in [0, 2**63).")
        rows = await self.core.store.list_rollouts(
            run_id=q.get("run_id"), status=q.get("status"), limit=limit, offset=offset
        )
        return JSONResponse({"rollouts": [r.public() for r in rows]})

    async def _rollout_or_404(self, request: Request) -> Session:
        session = await self.core.sessions.for_id(request.path_params["rollout_id"])
        if session is None:
            raise GatewayError(404, f"No rollout {request.path_params['rollout_id']}.", kind="not_found")
        return session

    async def admin_get_rollout(self, request: Request) -> Response:
        row = await self.core.store.get_rollout(request.path_params["rollout_id"])
        if row is None:
            raise GatewayError(404, f"No rollout {request.path_params['rollout_id']}.", kind="not_found")
        return JSONResponse(row.public())

    async def admin_calls(self, request: Request) -> Response:
        rollout_id = request.path_params["rollout_id"]
        if await self.core.store.get_rollout(rollout_id) is None:
            raise GatewayError(404, f"No rollout {rollout_id}.", kind="not_found")
        calls = public_calls(await self.core.store.calls(rollout_id))
        return JSONResponse({"rollout_id": rollout_id, "calls": calls})

    async def admin_image(self, request: Request) -> Response:
        """An image a call showed (or a harness uploaded), by digest, with its media type."""
        digest = request.path_params["digest"]
        image = (await self.core.store.images([digest])).get(digest)
        if image is None:
            raise GatewayError(404, f"No image {digest}.", kind="not_found")
        # Immutable: the digest is the content's own.
        headers = {"cache-control": "private, max-age=31536000, immutable"}
        return Response(image.data, media_type=image.media_type, headers=headers)

    # -- uploads --------------------------------------------------------------------------
    def _files_error(self, err: GatewayError, request: Request) -> Response:
        """Errors in Anthropic's shape for Anthropic's SDK (it sends its version header), else OpenAI's."""
        if "anthropic-version" in request.headers:
            for dialect in self.dialects:
                if dialect.name == "anthropic":
                    return dialect.error_response(err)
        return self.error(err, request)

    def _file_object(
        self, request: Request, image: Image, created_at: float, filename: str = ""
    ) -> dict[str, Any]:
        ext = image.media_type.split("/")[1]
        name = filename or f"{image.digest[:16]}.{'jpg' if ext == 'jpeg' else ext}"
        if "anthropic-version" in request.headers:
            created = datetime.fromtimestamp(created_at, UTC).isoformat().replace("+00:00", "Z")
            return {
                "id": file_id(image.digest),
                "type": "file",
                "filename": name,
                "mime_type": image.media_type,
                "size_bytes": len(image.data),
                "created_at": created,
                "downloadable": True,
            }
        return {
            "id": file_id(image.digest),
            "object": "file",
            "bytes": len(image.data),
            "created_at": int(created_at),
            "filename": name,
            "purpose": "vision",
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    async def upload_file(self, request: Request) -> Response:
        try:
            session = await self.dialect_routes.session(request)
            body = await read_body(request, self.max_body, json=False)
            share = session.rollout.id
            fields = await self.core.workers.run(
                _multipart, request.headers.get("content-type", ""), body, share=share
            )
            if "file" not in fields:
                raise bad_request("The upload needs a 'file' field (multipart/form-data).", param="file")
            filename, data = fields["file"]
            image = await self.core.workers.run(
                load_image, lambda: image_from_bytes(data), "file", share=share
            )
            created = await self.core.store.put_upload(session.rollout.id, image)
            return JSONResponse(self._file_object(request, image, created, filename))
        except GatewayError as err:
            return self._files_error(err, request)

    async def _uploaded(self, request: Request) -> tuple[Image, float]:
        session = await self.dialect_routes.session(request)
        ref = request.path_params["file_id"]
        digest = digest_of_file_id(ref)
        # Another rollout's upload is as unknown as a made-up id: nothing tells that it exists.
        found = (await self.core.store.uploads(session.rollout.id, [digest])).get(digest) if digest else None
        if found is None:
            raise GatewayError(404, f"No such file: '{ref}'.", kind="not_found")
        return found

    async def get_file(self, request: Request) -> Response:
        try:
            image, created = await self._uploaded(request)
        except GatewayError as err:
            return self._files_error(err, request)
        return JSONResponse(self._file_object(request, image, created))

    async def file_content(self, request: Request) -> Response:
        try:
            image, _ = await self._uploaded(request)
        except GatewayError as err:
            return self._files_error(err, request)
        return Response(image.data, media_type=image.media_type)

    async def _finish(self, request: Request, default_status: str) -> Response:
        session = await self._rollout_or_404(request)
        data = await self._json_body(request)
        reward = data.get("reward")
        if reward is not None and (
            isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
        ):
            raise bad_request("'reward' must be a finite number.", param="reward")
        details = data.get("details")
        if details is not None and not isinstance(details, dict):
            raise bad_request("'details' must be an object.", param="details")
        status = data.get("status", default_status)
        if status not in ("open", "closed", "failed", "cancelled"):
            raise bad_request("'status' must be one of open, closed, failed, cancelled.", param="status")
        if default_status == "open":  # setting a reward keeps the rollout's status unless asked
            status = data.get("status")
            if status == "open" and session.rollout.status != "open":
                # A finished rollout's key stays dead: reopening it would revive the key.
                raise GatewayError(
                    409,
                    f"Rollout {session.rollout.id} is {session.rollout.status}; it cannot be reopened.",
                    kind="permission",
                    param="status",
                )
            row = await self.core.store.update_rollout(
                session.rollout.id, status=status, reward=reward, details=details
            )
            assert row is not None
            session.rollout = row
        else:
            row = await self.core.sessions.close(session, status=status, reward=reward, details=details)
        return JSONResponse(row.public())

    async def admin_close_rollout(self, request: Request) -> Response:
        return await self._finish(request, "closed")

    async def admin_reward(self, request: Request) -> Response:
        return await self._finish(request, "open")

    async def admin_weights(self, request: Request) -> Response:
        data = await self._json_body(request)
        path = data.get("path")
        if not isinstance(path, str) or not path:
            raise bad_request("'path' (a model directory) is required.", param="path")
        # Every engine reads the checkpoint from this machine's filesystem (a remote one shares it).
        if not await asyncio.to_thread(os.path.isdir, path):
            raise bad_request(f"'path' {path!r} is not a model directory on the gateway's machine.", "path")
        try:
            version = await self.core.load_weights(path)
        except EngineUnavailable as exc:
            raise GatewayError(503, f"The engine cannot load weights now: {exc}", kind="unavailable") from exc
        except (EngineError, OSError, ValueError) as exc:  # a checkpoint the engine refuses
            raise bad_request(f"Cannot load the weights in {path!r}: {exc}", param="path") from exc
        return JSONResponse({"policy_version": version})

    async def admin_faults(self, request: Request) -> Response:
        """Queue errors (e.g. [429, 500]) that the rollout's next calls are answered with."""
        session = await self._rollout_or_404(request)
        errors = (await self._json_body(request)).get("errors")
        if not isinstance(errors, list) or not all(e in (429, 500, 503, 529) for e in errors):
            raise bad_request("'errors' must be a list of statuses among 429, 500, 503, 529.", param="errors")
        session.faults.extend(errors)
        return JSONResponse({"rollout_id": session.rollout.id, "pending_faults": session.faults})

    async def admin_stats(self, request: Request) -> Response:
        return JSONResponse(self.core.stats())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "policy_version": self.core.engine.policy_version})

    # -- the app --------------------------------------------------------------------------
    def app(self) -> Starlette:
        def admin(path: str, name: str, methods: list[str]) -> Route:
            async def endpoint(request: Request) -> Response:
                request.scope["route_name"] = name
                return await self.admin(request)

            return Route(path, endpoint, methods=methods, name=name)

        routes: list[BaseRoute] = [
            Route("/health", self.health, methods=["GET", "HEAD"]),
            admin("/admin/rollouts", "create_rollout", ["POST"]),
            admin("/admin/rollouts", "list_rollouts", ["GET"]),
            admin("/admin/rollouts/{rollout_id}", "get_rollout", ["GET"]),
            admin("/admin/rollouts/{rollout_id}/calls", "calls", ["GET"]),
            admin("/admin/rollouts/{rollout_id}/close", "close_rollout", ["POST"]),
            admin("/admin/rollouts/{rollout_id}/reward", "reward", ["POST"]),
            admin("/admin/rollouts/{rollout_id}/faults", "faults", ["POST"]),
            admin("/admin/weights", "weights", ["POST"]),
            admin("/admin/stats", "stats", ["GET"]),
            admin("/admin/images/{digest}", "image", ["GET"]),
        ]
        for dialect in self.dialects:
            for prefix in ("", "/r/{rollout_id}"):
                routes += self.dialect_routes.for_dialect(dialect, prefix)
        for prefix in ("", "/r/{rollout_id}"):
            routes += [
                Route(prefix + "/v1/files", self.upload_file, methods=["POST"]),
                Route(prefix + "/v1/files/{file_id}", self.get_file, methods=["GET"]),
                Route(prefix + "/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            ]
        for prefix in ("", "/r/{rollout_id}"):
            methods = ["GET", "POST", "PUT", "DELETE", "HEAD"]
            routes.append(Route(prefix + "/{rest:path}", self.not_found, methods=methods))
        return Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind: Any = {404: "not_found", 405: "invalid_request"}.get(exc.status_code, "invalid_request")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return self.error(GatewayError(exc.status_code, message, kind=kind), request)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        # A bug must not take the gateway down: answer 500 in the caller's dialect and go on. The
        # server closes the connection after an unhandled error, so the client is told not to reuse it.
        response = self.error(GatewayError(500, f"Internal gateway error: {exc!r}", kind="internal"), request)
        response.headers["connection"] = "close"
        return response


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str, bytes]]:
    """A multipart/form-data body's fields: name -> (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("Send the file as multipart/form-data (a 'file' field, and a 'purpose').")
    message = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    fields: dict[str, tuple[str, bytes]] = {}
    if message.is_multipart():
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            if isinstance(name, str) and isinstance(payload, bytes):
                fields[name] = (part.get_filename() or "", payload)
    return fields
