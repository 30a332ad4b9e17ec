"""The HTTP face of the endpoint: OpenAI's routes (FastAPI), plus feedback, tasks and stats.

Routes: GET /v1/models, POST /v1/chat/completions (streaming and tool calls in OpenAI's format),
POST /v1/completions, POST /v1/feedback, GET /v1/tasks (with --skill), GET /v1/trajectories/{id},
GET /v1/stats, GET /health. Errors use OpenAI's shape (`{"error": {"message", "type", ...}}`) so that
the official client raises them with our message. Responses carry the trajectory ids (header
`X-Trajectory-Id`, body `trajectory_ids`) that feedback refers to.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from skillswarm.node.endpoint.messages import RequestError
from skillswarm.node.endpoint.service import Completed, EndpointService
from skillswarm.node.endpoint.store import FeedbackError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
STREAM_PIECE_CHARS = 16


class _Refused(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


def _logprobs(choice: Any, tokenizer: Any) -> dict[str, Any]:
    return {"content": [{"token": tokenizer.decode([t], skip_special_tokens=False), "logprob": lp, "bytes": None,
                         "top_logprobs": []} for t, lp in zip(choice.token_ids, choice.logprobs)]}


def chat_response(done: Completed, model: str, tokenizer: Any, logprobs: bool) -> dict[str, Any]:
    """The non-streaming chat completion body."""
    return {"id": done.id, "object": "chat.completion", "created": done.created, "model": model,
            "choices": [{"index": i, "message": c.message, "finish_reason": c.finish_reason,
                         "logprobs": _logprobs(c, tokenizer) if logprobs else None} for i, c in enumerate(done.choices)],
            "usage": {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                      "total_tokens": done.prompt_tokens + done.completion_tokens},
            "trajectory_ids": [c.trajectory_id for c in done.choices], "group_id": done.group_id,
            "policy_version": done.policy_version}


def chat_chunks(done: Completed, model: str, include_usage: bool) -> list[dict[str, Any]]:
    """The same completion as OpenAI stream chunks: role, content pieces, tool-call deltas, finish, usage."""
    base = {"id": done.id, "object": "chat.completion.chunk", "created": done.created, "model": model,
            "trajectory_ids": [c.trajectory_id for c in done.choices], "group_id": done.group_id}
    chunks = []
    for i, c in enumerate(done.choices):
        chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        content = c.message.get("content") or ""
        for at in range(0, len(content), STREAM_PIECE_CHARS):
            piece = content[at:at + STREAM_PIECE_CHARS]
            chunks.append({**base, "choices": [{"index": i, "delta": {"content": piece}, "finish_reason": None}]})
        for k, call in enumerate(c.message.get("tool_calls") or []):
            delta = {"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": call["function"]}]}
            chunks.append({**base, "choices": [{"index": i, "delta": delta, "finish_reason": None}]})
        chunks.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": c.finish_reason}]})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": {"prompt_tokens": done.prompt_tokens,
                                                        "completion_tokens": done.completion_tokens,
                                                        "total_tokens": done.prompt_tokens + done.completion_tokens}})
    return chunks


def completion_response(done: Completed, model: str, logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    def lp(c: Any) -> dict[str, Any] | None:
        if not logprobs:
            return None
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
        return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": None}

    return {"id": done.id, "object": "text_completion", "created": done.created, "model": model,
            "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp(c)}
                        for i, c in enumerate(done.choices)],
            "usage": {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                      "total_tokens": done.prompt_tokens + done.completion_tokens},
            "trajectory_ids": [c.trajectory_id for c in done.choices], "group_id": done.group_id,
            "policy_version": done.policy_version}


def create_app(service: EndpointService, api_key: str | None = None) -> Any:
    """The FastAPI application over `service`; with `api_key`, every /v1 route needs `Authorization: Bearer KEY`."""
    async def guard(request: Request) -> None:
        """Every /v1 route: the API key when one is set, and the body size (a plain dependency: Starlette's
        BaseHTTPMiddleware would cost more per request than everything else the endpoint does)."""
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise _Refused(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            raise _Refused(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")

    app = FastAPI(title="skillswarm endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard)])

    @app.exception_handler(_Refused)
    async def refused(request: Request, e: _Refused) -> JSONResponse:
        return _error(e.status, str(e), e.kind)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, e: RequestError) -> JSONResponse:
        return _error(400, str(e))

    @app.exception_handler(FeedbackError)
    async def bad_feedback(request: Request, e: FeedbackError) -> JSONResponse:
        return _error(e.status, str(e))

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(f"request body over {MAX_BODY_BYTES >> 20} MiB")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": int(service.started),
                                            "owned_by": "skillswarm"}]}

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Any:
        body = await body_of(request)
        done = await service.chat(body, request.headers)
        headers = {"X-Trajectory-Id": ",".join(c.trajectory_id for c in done.choices), "X-Group-Id": done.group_id}
        if body.get("stream"):
            options = body.get("stream_options") or {}
            chunks = chat_chunks(done, service.model_name, bool(isinstance(options, dict) and options.get("include_usage")))

            async def events() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        logprobs = body.get("logprobs") is True
        return JSONResponse(chat_response(done, service.model_name, service.tokenizer, logprobs), headers=headers)

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        if body.get("stream"):
            return _error(400, "stream is supported on /v1/chat/completions only")
        done = await service.complete(body, request.headers)
        wanted = body.get("logprobs")
        logprobs = isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0
        headers = {"X-Trajectory-Id": ",".join(c.trajectory_id for c in done.choices), "X-Group-Id": done.group_id}
        return JSONResponse(completion_response(done, service.model_name, logprobs, service.tokenizer), headers=headers)

    @v1.post("/feedback")
    async def feedback(request: Request) -> Any:
        body = await body_of(request)
        tid = body.get("trajectory_id")
        if not isinstance(tid, str):
            return _error(400, "feedback needs trajectory_id (a string) and reward (a number)")
        if "reward" not in body:
            return _error(400, "feedback needs reward (a number)")
        traj = service.store.score(tid, body.get("reward"), body.get("turn_rewards"), body.get("correct"), body.get("reason"))
        return {"trajectory_id": traj.id, "group_id": traj.group, "status": traj.status, "reward": traj.reward}

    @v1.get("/tasks")
    async def tasks(n: int = 1, split: str = "train", seed: int | None = None) -> Any:
        return {"skill": service.skill.name if service.skill else None, "tasks": service.issue_tasks(n, split, seed)}

    @v1.get("/trajectories/{trajectory_id}")
    async def trajectory(trajectory_id: str) -> Any:
        found = service.trajectory(trajectory_id)
        return found if found is not None else _error(404, f"unknown trajectory {trajectory_id!r}")

    @v1.get("/stats")
    async def stats() -> dict[str, Any]:
        return service.stats()

    app.include_router(v1)
    return app
