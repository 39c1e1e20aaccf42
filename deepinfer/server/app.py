"""The FastAPI application: routes, API-key auth, error rendering, admin endpoints.

`build_app(engine, ...)` wires an `AsyncEngine` to the HTTP surface; `serve(config)`
loads the engine and runs uvicorn. Every error leaves as OpenAI's
{"error": {...}} with a meaningful status; bad input never yields a 500.
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer import __version__
from deepinfer.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.openai_api import (
    ServingContext,
    chat_completion,
    chat_messages,
    completion,
)
from deepinfer.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status, headers=headers)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="deepinfer", version=__version__)
    metrics = ServerMetrics(engine.stats, model_name)
    ctx = ServingContext(engine, model_name, metrics)
    app.state.ctx = ctx
    created = int(time.time())

    # a dependency, not middleware: Starlette's BaseHTTPMiddleware hides client disconnects from handlers
    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authenticate)])

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError):
        return _error(400, str(e))

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, e: QueueFullError):
        return _error(429, str(e), type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return _error(503, str(e), type="server_error", code="engine_dead")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist.", type="invalid_request_error",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return _error(503, "the engine loop has stopped", type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "deepinfer",
            "root": model_name, "parent": None, "max_model_len": engine.max_model_len,
        }]}

    @api.get("/v1/models/{name:path}")
    async def model_info(name: str):
        check_model(name)
        return {"id": model_name, "object": "model", "created": created, "owned_by": "deepinfer",
                "max_model_len": engine.max_model_len}

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        return await chat_completion(ctx, req, raw)

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        return await completion(ctx, req, raw)

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            from deepinfer.recipe.tokenizer import render_chat

            ids = render_chat(tok, chat_messages(req), req.add_generation_prompt)
        elif req.prompt is not None:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < engine.engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    app.include_router(api)
    return app


def serve(engine_config, server_config, customize=None) -> None:
    """Load the engine, then serve HTTP until interrupted. `customize(app, engine)`, if given, adds to the
    app before it serves (a cluster worker's /internal routes)."""
    import uvicorn

    from deepinfer.config import ServerConfig

    server_config = server_config or ServerConfig()
    print("deepinfer: loading model and allocating the KV cache ...", flush=True)
    engine = AsyncEngine(engine_config)
    core = engine.engine.core
    name = engine_config.model.served_model_name or core.files.name
    print(f"deepinfer: model {name} ({core.runner.dtype}, {core.runner.device}); KV cache {core.runner.num_blocks} "
          f"blocks x {core.config.cache.block_size} tokens; max_model_len {engine.max_model_len}", flush=True)
    tiers = core.tiers
    host = tiers.host if tiers is not None else None
    store = tiers.store if tiers is not None else None
    print(f"deepinfer: KV host tier {f'{host.max_bytes / 2**20:.0f} MiB' if host is not None else 'off'}; "
          f"KV store {store.root if store is not None else 'off'}", flush=True)
    app = build_app(engine, name, server_config.api_key)
    if customize is not None:
        customize(app, engine)
    url = f"http://{server_config.host}:{server_config.port}"
    print(f"deepinfer: serving {name} at {url}/v1 (OpenAI-compatible; Ctrl-C stops)", flush=True)
    try:
        uvicorn.run(app, host=server_config.host, port=server_config.port,
                    log_level=server_config.uvicorn_log_level, timeout_graceful_shutdown=5,
                    lifespan="off")  # no startup/shutdown hooks; "auto" logs a traceback on Ctrl-C
    finally:
        engine.shutdown()
