"""The FastAPI application: routes, API-key auth, error rendering, admin endpoints; request limits and admission
(server/limits.py) run in front of the routes.

`build_app(engine, ...)` wires an `EngineClient` to the HTTP surface; `serve(config)`
loads the engine and runs uvicorn. Every error leaves as OpenAI's {"error": {...}}
(Anthropic's {"type": "error", "error": {...}} on /v1/messages paths) with a meaningful
status; bad input never yields a 500.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer import __version__
from deepinfer.cluster.auth import require_token
from deepinfer.config import LimitsConfig
from deepinfer.engine.engine_client import EngineClient, EngineDeadError, QueueFullError
from deepinfer.recipe.output import RecipeOptions
from deepinfer.server.anthropic_api import count_tokens, create_message
from deepinfer.server.limits import Admission, AdmissionCollector, RequestLimits
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.openai_api import (
    ServingContext,
    chat_completion,
    chat_messages,
    check_prefill_flags,
    completion,
)
from deepinfer.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from deepinfer.server.protocol_anthropic import CountTokensRequest, MessagesRequest, anthropic_error_body
from deepinfer.server.protocol_responses import ResponsesRequest
from deepinfer.server.response_store import ResponseStore
from deepinfer.server.responses_api import create_response, delete_response, stored_response
from deepinfer.server.serving import tenant_of
from deepinfer.server.tenants import Tenants
from deepinfer.server.tooling import ToolPlan, render_with_images

logger = logging.getLogger(__name__)


ANTHROPIC_PREFIX = "/v1/messages"


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
           headers=None, request: Request | None = None) -> JSONResponse:
    if request is not None and request.url.path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status, headers=headers)


def recipe_options(tokenizer, architectures: list[str] | None, tool_parser: str = "auto",
                   reasoning_parser: str = "auto") -> RecipeOptions:
    """The model's tool-call and reasoning parsers: as configured, or detected from its chat template."""
    from deepinfer.recipe.reasoning import resolve_reasoning_parser
    from deepinfer.recipe.tool_parsers import detect_tool_parser, get_tool_parser

    template = getattr(tokenizer, "chat_template", None)
    tools = detect_tool_parser(template, architectures) if tool_parser == "auto" else tool_parser
    get_tool_parser(tools)  # ValueError for an unknown name
    return RecipeOptions(tool_parser=tools, reasoning_parser=resolve_reasoning_parser(reasoning_parser, template))


def build_app(engine: EngineClient, model_name: str | Sequence[str], api_key: str | Sequence[str] | None = None, *,
              recipe: RecipeOptions | None = None, responses: ResponseStore | None = None,
              api_token: str | None = None, limits: LimitsConfig | None = None,
              cors: dict | None = None) -> FastAPI:
    """`api_key`: one key or several (`KEY` or `KEY=GROUP` each, see `server/tenants.py`); each key is a
    tenant whose requests get a prefix cache namespace of their own. None: no auth, one namespace.
    `api_token`: a cluster worker's cluster token, which its API routes then require as well (in
    `CLUSTER_TOKEN_HEADER`): clients must go through the router, which checks their API keys.
    `cors`: CORSMiddleware's keyword arguments (`ServerConfig.cors_options`); None: no CORS answers.
    `model_name`: the name requests may give, or several (`--served-model-name a b`): responses report the first."""
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    model_name = names[0]
    app = FastAPI(title="deepinfer", version=__version__)
    metrics = ServerMetrics(engine.stats, model_name)
    # request limits and admission run before routing and pydantic (server/limits.py)
    limits = limits or LimitsConfig()
    admission = Admission(limits, lambda: engine.running_capacity, getattr(engine, "max_queue", None))
    app.add_middleware(RequestLimits, limits=limits, admission=admission, max_model_len=lambda: engine.max_model_len)
    if cors is not None:  # added last, so outermost: a preflight is answered before limits and auth see it
        app.add_middleware(CORSMiddleware, **cors)
    metrics.registry.register(AdmissionCollector(admission))
    app.state.admission = admission
    if recipe is None:
        recipe = recipe_options(engine.tokenizer, None)
    ctx = ServingContext(engine, model_name, metrics, recipe, limits.allowed_media_domains)
    responses = responses if responses is not None else ResponseStore()
    app.state.ctx = ctx
    created = int(time.time())

    tenants = Tenants((api_key,) if isinstance(api_key, str) else api_key or ())

    # a dependency, not middleware: Starlette's BaseHTTPMiddleware hides client disconnects from handlers
    async def authenticate(request: Request) -> None:
        """The key's tenant goes on `request.state.cache_tenant` (the handlers pass it to the engine); a
        client has no other way to set it."""
        request.state.cache_tenant = None
        if not tenants:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        tenant = tenants.match(token)
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        request.state.cache_tenant = tenant.cache_id

    # the token first: a caller without it learns nothing, not even whether its API key is valid. /health
    # and /metrics stay open (outside `api`): launchers, probes and scrapers read them, and they tell
    # nothing of any tenant's requests
    refuse = require_token(api_token, "this is a cluster worker: send API requests to the router")
    api = APIRouter(dependencies=[Depends(refuse), Depends(authenticate)])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code, e.headers, request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), type="not_found_error" if e.status_code == 404 else
                      "invalid_request_error", request=request)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError):  # RequestError (validation.py) names its field
        return _error(400, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None), request=request)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, e: QueueFullError):
        return _error(429, str(e), type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"},
                      request=request)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return _error(503, str(e), type="server_error", code="engine_dead", request=request)

    def check_model(name: str | None) -> ServingContext:
        """The context a request naming `name` runs in: the base model's, or one that names its LoRA adapter
        (`engine.lora_adapters`: name -> directory, None where the engine serves none; kept in step with the
        engine by the load / unload routes below)."""
        if name is None or name in names:
            return ctx
        adapters = engine.lora_adapters
        if adapters is not None and name in adapters:
            return dataclasses.replace(ctx, model_name=name, lora=name)
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

    def model_card(name: str) -> dict:
        # vLLM's shape: an adapter's root is its directory and its parent the base model
        adapters = engine.lora_adapters
        lora = adapters is not None and name in adapters and name not in names
        return {"id": name, "object": "model", "created": created, "owned_by": "deepinfer",
                "root": adapters[name] if lora else model_name, "parent": model_name if lora else None,
                "max_model_len": engine.max_model_len}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in (*names, *sorted(engine.lora_adapters or ()))]}

    @api.get("/v1/models/{name:path}")
    async def model_info(name: str):
        check_model(name)
        return model_card(name)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        adapters = engine.lora_adapters
        if adapters is None:
            raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)")
        if not engine.loads_lora_adapters:
            raise APIError(400, "a cluster serves its workers' --lora-modules; adapters are not loaded through the "
                           "router")
        if req.lora_name in names:
            raise APIError(400, f"{req.lora_name!r} names the base model", param="lora_name")
        try:
            await engine.call("load_lora_adapter", req.lora_name, req.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        adapters[req.lora_name] = req.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        adapters = engine.lora_adapters
        if adapters is not None and not engine.loads_lora_adapters:
            raise APIError(400, "a cluster serves its workers' --lora-modules; adapters are not unloaded through "
                           "the router")
        if adapters is None or req.lora_name not in adapters:
            raise APIError(404, f"The LoRA adapter `{req.lora_name}` is not loaded.", type="not_found_error",
                           param="lora_name", code="model_not_found")
        await engine.call("unload_lora_adapter", req.lora_name)
        del adapters[req.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await chat_completion(check_model(req.model), req, raw)

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await completion(check_model(req.model), req, raw)

    @api.post("/v1/responses")
    async def responses_create(req: ResponsesRequest, raw: Request):
        return await create_response(check_model(req.model), req, responses, raw)

    @api.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, raw: Request):
        return stored_response(responses, response_id, tenant_of(raw))

    @api.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str, raw: Request):
        return delete_response(responses, response_id, tenant_of(raw))

    @api.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request):
        return await create_message(check_model(req.model), req, raw)

    @api.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest):
        check_model(req.model)
        return await count_tokens(ctx, req)

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            check_prefill_flags(req)
            ids, _ = render_with_images(ctx, chat_messages(req, images=engine.multimodal_processor is not None), ToolPlan(),
                                        "messages", req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message)
        elif req.prompt is not None:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    app.include_router(api)
    return app


def serve(engine_config, server_config, customize=None, api_token: str | None = None) -> None:
    """Load the engine, then serve HTTP until interrupted. `customize(app, engine)`, if given, adds to the
    app before it serves (a cluster worker's /internal routes); `api_token`: see `build_app`."""
    import uvicorn

    from deepinfer.config import ServerConfig

    server_config = server_config or ServerConfig()
    print("deepinfer: loading model and allocating the KV cache ...", flush=True)
    engine = start_engine(engine_config, server_config.engine_process)
    info = engine.facts
    names = engine_config.model.served_model_name or (info["model_name"],)
    name = names[0]
    print(f"deepinfer: model {name} ({info['dtype']}, {info['device']}); KV cache {info['num_blocks']} "
          f"blocks x {info['block_size']} tokens; max_model_len {engine.max_model_len}; engine "
          f"{'in its own process' if server_config.engine_process else 'on a server thread'}", flush=True)
    host, store = info["host_tier_bytes"], info["store_root"]
    print(f"deepinfer: KV host tier {f'{host / 2**20:.0f} MiB' if host is not None else 'off'}; "
          f"KV store {store or 'off'}", flush=True)
    from deepinfer.recipe.tokenizer import use_chat_template

    use_chat_template(engine.tokenizer, server_config.chat_template)  # before the parsers read the template
    recipe = recipe_options(engine.tokenizer, info.get("architectures"), server_config.tool_parser,
                            server_config.reasoning_parser)
    print(f"deepinfer: tool parser {recipe.tool_parser}; reasoning parser {recipe.reasoning_parser or 'none'}",
          flush=True)
    app = build_app(engine, names, server_config.api_key, recipe=recipe,
                    responses=ResponseStore(server_config.responses_store_size, server_config.responses_store_ttl),
                    api_token=api_token, limits=server_config.limits, cors=server_config.cors_options())
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


def start_engine(engine_config, in_own_process: bool) -> EngineClient:
    if engine_config.parallel.expert_parallel_size > 1:  # the ranks are processes, whatever in_own_process says
        from deepinfer.engine.ep_engine import ExpertParallelEngine

        return ExpertParallelEngine(engine_config)
    if in_own_process:
        from deepinfer.engine.process_engine import ProcessEngine

        return ProcessEngine(engine_config)
    from deepinfer.engine.async_engine import AsyncEngine

    return AsyncEngine(engine_config)

