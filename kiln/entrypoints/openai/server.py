"""``kiln serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

The port listens from the first second: the model loads in a background thread
while ``/health`` answers 503, so probes can tell loading from dead; every other
endpoint answers 503 until the engine is ready. After an engine death ``/health``
turns 503 for good. Errors use OpenAI's envelope; validation failures are 400
(never FastAPI's 422) and name the field; a bad request never reaches the
scheduler, and the server keeps serving. With an API key (``--api-key`` or
``KILN_API_KEY``) every ``/v1`` path asks for ``Authorization: Bearer <key>``,
as vLLM's ``--api-key`` does; probes (``/health``, ``/metrics``, ``/version``)
and the tokenizer's paths stay open.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.engine.loader import LoadedEngine, load_engine
from kiln.entrypoints.async_engine import AsyncEngine, EngineDeadError
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kiln.entrypoints.openai.serving import OpenAIServing, sse
from kiln.version import __version__

__all__ = ["ServerState", "build_app"]

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    model_name: str
    load_args: tuple[str, dict[str, Any]]  # (model, Runtime.load options)
    engine: AsyncEngine | None = None
    serving: OpenAIServing | None = None
    load_error: BaseException | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics | None = None
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's
    tool_call_parser: str | None = None  # --tool-call-parser: chat answers are parsed for calls
    reasoning_parser: str | None = None  # --reasoning-parser: chat answers' reasoning is split off
    api_key: str | None = None  # --api-key: the /v1 paths need it as a bearer token

    def ready(self) -> OpenAIServing:
        if self.load_error is not None:
            raise APIError(f"the model failed to load: {self.load_error}", status=503)
        if self.serving is None or self.engine is None:
            raise APIError("the model is still loading", status=503)
        if not self.engine.healthy:
            raise APIError(f"the engine stopped: {self.engine.dead}", status=503)
        return self.serving


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return _error(APIError(f"the request body is not valid JSON: {first.get('msg', '')}"))
    return _error(APIError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}", param=param))


def _load_in_background(state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
    def load() -> None:
        try:
            model, options = state.load_args
            loaded: LoadedEngine = load_engine(model, **options)
        except BaseException as e:  # noqa: BLE001  (reported by /health and every endpoint)
            logger.exception("loading %s failed", state.load_args[0])
            state.load_error = e
            return
        loop.call_soon_threadsafe(_start_engine, state, loaded)

    threading.Thread(target=load, name="kiln-load", daemon=True).start()


def _start_engine(state: ServerState, loaded: LoadedEngine) -> None:
    engine = AsyncEngine(loaded)
    engine.start()
    metrics = ServerMetrics(state.model_name, lambda: engine.stats, lambda: engine.startup_report)
    metrics.record_startup(loaded.startup_report)
    state.metrics, state.engine = metrics, engine
    state.serving = OpenAIServing(engine, state.model_name, metrics, chat_template=state.chat_template,
                                  tool_call_parser=state.tool_call_parser, reasoning_parser=state.reasoning_parser)
    logger.info("kiln serve: %s ready in %.1fs", state.model_name, loaded.startup_report["total_seconds"])


async def _sse_or_error(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream's chunks; an error after the first is an SSE event. ``[DONE]`` always ends it."""
    try:
        async for chunk in body:
            yield chunk
    except APIError as e:
        yield sse(e.body())
    except EngineDeadError as e:
        yield sse(APIError(str(e), status=500).body())
    except Exception as e:  # noqa: BLE001  (the client gets it as an event; the server goes on)
        logger.exception("stream failed")
        yield sse(APIError(f"internal error: {e}", status=500).body())
    yield sse("[DONE]")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _load_in_background(state, asyncio.get_running_loop())
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan)
    app.add_exception_handler(APIError, lambda request, exc: _error(exc))  # type: ignore[arg-type,return-value]
    app.add_exception_handler(RequestValidationError, lambda r, exc: _validation_error(exc))  # type: ignore[arg-type,return-value]
    app.add_exception_handler(EngineDeadError, lambda r, exc: _error(APIError(str(exc), status=500)))  # type: ignore[arg-type,return-value]
    if state.api_key is not None:
        _require_key(app, state.api_key)
    _routes(app, state)
    return app


def _require_key(app: FastAPI, key: str) -> None:
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):  # in constant time
                return _error(APIError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                                       status=401))
        return await call_next(request)


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            state.ready()
        except APIError as e:
            return Response(status_code=503, content=e.message)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        serving = state.ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "kiln", "root": state.model_name,
                                            "max_model_len": serving.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.ready()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")  # type: ignore[union-attr]

    _token_routes(app, state)
    _generation_routes(app, state)


def _token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        serving = state.ready()
        serving.check_model(body.get("model"))
        tokenizer = serving.engine.tokenizer
        if "messages" in body:
            from kiln.entrypoints.chat import render_chat

            try:
                ids = render_chat(tokenizer, body["messages"], body.get("chat_template_kwargs"),
                                  tools=body.get("tools"), chat_template=state.chat_template,
                                  add_generation_prompt=body.get("add_generation_prompt"),
                                  continue_final_message=bool(body.get("continue_final_message", False)))
            except ValueError as e:
                raise APIError(str(e), param="messages") from None
        elif isinstance(body.get("prompt"), str):
            ids = list(tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)))
        else:
            raise APIError("send 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any]) -> dict[str, Any]:
        serving = state.ready()
        serving.check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = serving.engine.config.model.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise APIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": serving.engine.tokenizer.decode(tokens)}


def _generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        serving = state.ready()
        if req.stream:
            choices = serving.completion_choices(req)  # validation errors are still a 400
            return StreamingResponse(_sse_or_error(serving.completion_stream(req, choices)),
                                     media_type="text/event-stream")
        return await serving.completions(req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        serving = state.ready()
        if req.stream:
            choices = serving.chat_choices(req)
            return StreamingResponse(_sse_or_error(serving.chat_stream(req, choices)),
                                     media_type="text/event-stream")
        return await serving.chat(req)


def serve(model: str, *, host: str, port: int, served_model_name: str | None, load_options: dict[str, Any],
          log_level: str = "info", chat_template: str | None = None, tool_call_parser: str | None = None,
          reasoning_parser: str | None = None, api_key: str | None = None) -> int:
    """Run the server until interrupted."""
    import uvicorn

    state = ServerState(served_model_name or model, (model, load_options), chat_template=chat_template,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, api_key=api_key)
    uvicorn.run(build_app(state), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return 0
