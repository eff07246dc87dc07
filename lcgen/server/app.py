"""The HTTP side: Starlette routes, the API key, the body limit, errors in OpenAI's shape, and
streaming by server-sent events. Generation itself happens in the :class:`Engine` thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import lcgen
import lcgen.tools
from lcgen.server.engine import Engine, Finished, Job, Piece, QueueFullError
from lcgen.server.requests import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_api_key,
    check_cors_origins,
    constraint_field,
    field_named,
    max_tokens,
    n_logprobs,
    options,
    parse,
)
from lcgen.server.responses import Echo, Kind, Output, Reply, usage

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A stream's time to end by itself when the server stops (its choices fail at once, with an
# error event and [DONE]) before sse-starlette cuts it off.
STREAM_SHUTDOWN_GRACE_S = 5.0
AnyRequest = ChatRequest | CompletionRequest
R = TypeVar("R", ChatRequest, CompletionRequest)


class _Server:
    def __init__(
        self,
        model: lcgen.Model,
        name: str,
        engine: Engine,
        api_key: str | None,
        max_body_bytes: int,
        draft: lcgen.Model | None = None,
    ) -> None:
        self.model, self.name, self.engine, self.draft = model, name, engine, draft
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.names = {name, model.path.name, model.path.stem}
        self.created = int(time.time())

    # endpoints -------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = await self._request(request, ChatRequest)
        if not self.model.has_chat_template:
            raise APIError(
                400,
                f"messages: {self.name} has no chat template (a base model): send the text "
                "to /v1/completions as its prompt",
                param="messages",
            )
        callable_tools = req.callable_tools()
        try:
            messages = lcgen.tools.prompt_messages(
                [m.as_dict() for m in req.messages],
                callable_tools,
                req.tool_required,
                req.tool_parallel,
                formatted=req.response_format is not None and req.response_format.type != "text",
            )
            prompt = await run_in_threadpool(self.model.chat_tokens, messages)
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        return await self._generate(
            request,
            req,
            [prompt],
            "chat",
            tools=frozenset(t.name for t in callable_tools),
            parallel=req.tool_parallel,
        )

    async def completions(self, request: Request) -> Response:
        req = await self._request(request, CompletionRequest)
        given = req.prompt
        items = [given] if isinstance(given, str) or isinstance(given[0], int) else given
        suffix = req.suffix
        # A text prompt's special-token text (a chat template applied by the client) is read as
        # those tokens, as llama.cpp's server reads it: the whole prompt is the client's own.
        tokens_of = (
            partial(self.model.tokenize, special=True)
            if suffix is None
            else partial(self._infill, suffix=suffix)
        )
        texts, prompts = [], []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                prompts.append(await run_in_threadpool(tokens_of, item))
            else:  # token ids, as given (no BOS added)
                ids = self._token_prompt(item, suffix)
                texts.append(self.model.detokenize(ids))
                prompts.append(ids)
        if not all(prompts):
            raise APIError(400, "prompt: a prompt is empty", param="prompt")
        echo = None
        if req.echo:
            top = n_logprobs(req)
            heal = req.token_healing and req.max_tokens != 0  # (0: nothing is generated)
            echo = [
                await run_in_threadpool(self._echo, text, tokens, top, heal)
                for text, tokens in zip(texts, prompts, strict=True)
            ]
        return await self._generate(request, req, prompts, "text", echo=echo)

    def _token_prompt(self, ids: list[int], suffix: str | None) -> list[int]:
        if suffix is not None:
            raise APIError(400, "suffix needs a text prompt, not token ids", param="suffix")
        try:
            return self.model.vocab.check_tokens(ids)
        except ValueError as exc:
            raise APIError(400, f"prompt: {exc}", param="prompt") from None

    def _infill(self, prefix: str, suffix: str) -> list[int]:
        try:
            return self.model.infill_tokens(prefix, suffix)
        except ValueError as exc:
            raise APIError(400, f"suffix: {exc}", param="suffix") from None

    def _echo(self, text: str, tokens: list[int], top: int | None, heal: bool) -> Echo:
        """A prompt to echo: its text, and with log-probabilities each token's (the first has
        none); with ``heal``, the text of the last token, which the generation re-creates (as
        :meth:`lcgen.Sequence.heal_last_token` takes it)."""
        piece = self.model.vocab.piece(tokens[-1]) if heal and len(tokens) > 1 else b""
        healed = piece.decode("utf-8", "replace")
        if top is None:
            return text, None, healed
        try:
            scored = self.model.prompt_logprobs(tokens, top=top)
        except lcgen.ContextFullError as exc:  # longer than the context
            raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        except ValueError as exc:  # any other prompt it cannot score: still the request's
            raise APIError(400, f"prompt: {exc}", param="prompt") from None
        return text, (tokens[0], scored), healed

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def one_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model, under any of the names it answers to."""
        self._authorize(request)
        name = request.path_params["name"]
        if not name:  # /v1/models/
            return await self.models(request)
        if name not in self.names:
            raise APIError(
                404,
                f"the model {name!r} does not exist: this server has {self.name!r}",
                code="model_not_found",
            )
        return JSONResponse(self._model_entry())

    def _model_entry(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "lcgen"}

    async def health(self, request: Request) -> Response:
        stats = self.model.cache.stats
        return JSONResponse(
            {
                "status": "ok",
                "model": self.name,
                "slots": {
                    "total": stats.live + stats.entries + stats.free_slots,
                    "live": stats.live,
                    "available": stats.free_slots + stats.entries - stats.pinned,
                },
                "queue": {
                    "waiting": self.engine.n_waiting,
                    "running": self.engine.n_running,
                    "max": self.engine.max_queue,
                },
                "cache": dataclasses.asdict(stats),
                "threads": {
                    "max": self.model.n_threads,
                    "now": self.model.threads_now,
                    "adaptive": self.model.adaptive_threads,
                },
            }
        )

    # reading a request -----------------------------------------------------------------
    async def _request(self, request: Request, cls: type[R]) -> R:
        self._authorize(request)
        req = parse(cls, await self._body(request))
        if req.model not in self.names:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist: this server has {self.name!r}",
                param="model",
                code="model_not_found",
            )
        return req

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )

    async def _body(self, request: Request) -> bytes:
        too_big = APIError(
            413,
            f"the request body is larger than {self.max_body_bytes} bytes",
            code="body_too_large",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                raise too_big
        return bytes(body)

    def _job(
        self,
        req: AnyRequest,
        prompts: list[list[int]],
        kind: Kind,
        loop: asyncio.AbstractEventLoop,
    ) -> Job | None:
        """The request made into a job: its plan (the constraint compiled), one per choice,
        the prompts checked against the context; None for ``max_tokens`` 0 (echo only)."""
        n_ctx, longest = self.model.n_ctx, max(map(len, prompts))
        limit = max_tokens(req)
        to_end = limit is None and kind == "chat"  # up to the end of the context
        if limit is None:
            limit = max(n_ctx - longest, 1) if to_end else COMPLETION_MAX_TOKENS
        if longest + limit > n_ctx:  # (limit 0: echo alone, scored as a whole context)
            asked = "" if to_end else f" + {limit} max_tokens = {longest + limit}"
            which = ""
            if len(prompts) > 1:  # which of the prompts: the longest
                which = f" (prompt {[len(p) for p in prompts].index(longest)} of {len(prompts)})"
            raise APIError(
                400,
                f"this model's context is {n_ctx} tokens; the request needs {longest} prompt "
                f"tokens{which}{asked}{' and room for a token to generate' * (limit > 0)}: "
                "shorten the prompt" + ("" if to_end else " or lower max_tokens"),
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if limit == 0:
            return None
        try:
            plan = lcgen.make_plan(max_tokens=limit, **options(req, self.model.n_vocab, self.draft))
            if plan.constraint is not None:
                # Here, beside the engine: a grammar llguidance refuses may take seconds to
                # set up and then mask too slowly (GrammarTooSlowError): a 400, not a stall of
                # every client; compiled grammars are kept, so the engine reuses this work.
                _check_constraint(plan.constraint, self.model, constraint_field(req))
        except (TypeError, ValueError, lcgen.LcgenError) as exc:
            param = field_named(str(exc), type(req), req.model_fields_set)
            code = None
            if isinstance(exc, lcgen.GrammarTooSlowError):
                param, code = constraint_field(req), "grammar_too_slow"
            raise APIError(400, str(exc), param=param, code=code) from None
        seeds = [None if req.seed is None else (req.seed + i) % 2**64 for i in range(req.n)]
        return Job(
            [p for p in prompts for _ in seeds],
            [plan.with_seed(s) for _ in prompts for s in seeds],
            loop,
        )

    # answering -----------------------------------------------------------------------------
    async def _generate(
        self,
        request: Request,
        req: AnyRequest,
        prompts: list[list[int]],
        kind: Kind,
        *,
        tools: frozenset[str] = frozenset(),
        parallel: bool = False,
        echo: list[Echo] | None = None,
    ) -> Response:
        """Answer ``req``; ``tools``: the functions the reply may call, ``parallel``: whether
        several (see :class:`Reply`)."""
        loop = asyncio.get_running_loop()
        job = await run_in_threadpool(self._job, req, prompts, kind, loop)
        plans = job.plans if job is not None else None
        reply = Reply(
            kind,
            req.model,
            self.model,
            n_logprobs(req) is not None,
            tools,
            parallel,
            plans,
            include_usage=req.include_usage,
            fingerprint=self.model.system_fingerprint,
        )
        count = _Count(prompts, req.n)
        outputs = [Output(i) for i in range(len(prompts) * req.n)]
        if echo is not None:
            for out in outputs:
                reply.echo(out, *echo[out.index // req.n])
        if job is None:  # max_tokens 0: the echoed prompts only
            for out in outputs:
                out.finish_reason = "length"
            if req.stream:
                return _event_stream(self._echo_events(reply, outputs, count, req))
            return JSONResponse(reply.whole(outputs, count.usage(outputs)))
        try:
            self.engine.submit(job)
        except lcgen.ClosedError as exc:  # it came after the engine stopped
            raise _failure(exc) from None
        except QueueFullError as exc:
            # Retry-After: what clients (the openai package among them) wait before retrying
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ValueError as exc:  # more choices than the queue holds: never admitted
            raise APIError(400, str(exc), param="n", code="too_many_choices") from None
        if req.stream:
            events = self._events(job, reply, outputs, count, req.include_usage)
            return _event_stream(events, BackgroundTask(self.engine.cancel, job))
        watcher = asyncio.create_task(_cancel_on_disconnect(request, self.engine, job))
        try:
            async for item in job.items():
                if isinstance(item, Piece):
                    reply.take(outputs[item.index], item.chunk, item.healed)
                elif isinstance(item, Finished):
                    outputs[item.index].cached_tokens = item.cached_tokens
                else:
                    raise _failure(item.error)
        finally:
            gone = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            self.engine.cancel(job)
        if gone:  # the client went away: its choices were cancelled, nobody reads a reply
            return Response(status_code=499)
        return JSONResponse(reply.whole(outputs, count.usage(outputs)))

    async def _echo_events(
        self, reply: Reply, outputs: list[Output], count: _Count, req: AnyRequest
    ) -> AsyncIterator[str]:
        """A streamed reply of echoed prompts only (max_tokens 0)."""
        for out in outputs:
            yield json.dumps(reply.echo_chunk(out))
            for event in reply.end_chunks(out):
                yield json.dumps(event)
        if req.include_usage:
            yield json.dumps(reply.usage_chunk(count.usage(outputs)))
        yield "[DONE]"

    async def _events(
        self, job: Job, reply: Reply, outputs: list[Output], count: _Count, include_usage: bool
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed reply, ``[DONE]`` last; leaving early (the
        client went away) cancels the job."""
        waiting = set() if reply.kind != "chat" or reply.role_first else set(range(job.n))

        def opened(events: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
            """``events`` of a choice, opened by its role where that waited for them."""
            if not events or index not in waiting:
                return events
            waiting.discard(index)
            return [*reply.opening(events[0]), *events[1:]]

        try:
            if reply.role_first:
                for i in range(job.n):
                    yield json.dumps(reply.role_chunk(i))
            for out in outputs:
                if out.parts:  # an echoed prompt
                    yield json.dumps(reply.echo_chunk(out))
            async for item in job.items():
                if isinstance(item, Piece):
                    entries = reply.take(outputs[item.index], item.chunk, item.healed)
                    event = reply.piece_chunk(outputs[item.index], item.chunk, entries)
                    for each in opened([] if event is None else [event], item.index):
                        yield json.dumps(each)
                elif isinstance(item, Finished):
                    outputs[item.index].cached_tokens = item.cached_tokens
                    for event in opened(reply.end_chunks(outputs[item.index]), item.index):
                        yield json.dumps(event)
                else:
                    yield json.dumps(_failure(item.error).body())
            if include_usage:
                yield json.dumps(reply.usage_chunk(count.usage(outputs)))
            yield "[DONE]"
        finally:
            self.engine.cancel(job)


def _event_stream(
    events: AsyncIterator[str], background: BackgroundTask | None = None
) -> EventSourceResponse:
    return EventSourceResponse(
        events, background=background, shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Count:
    """What ``usage`` counts: each prompt once; the tokens its first choice found cached."""

    prompts: list[list[int]]
    n: int

    def usage(self, outputs: list[Output]) -> dict[str, Any]:
        cached = sum(outputs[k * self.n].cached_tokens for k in range(len(self.prompts)))
        return usage(sum(map(len, self.prompts)), sum(o.n_tokens for o in outputs), cached)


def _check_constraint(grammar: lcgen.Grammar, model: lcgen.Model, field: str | None) -> None:
    """:meth:`lcgen.Grammar.check`: a grammar llama.cpp rejects is a plain 400 (raised), one
    that no token can start a 400 ``unsatisfiable_constraints`` naming ``field``."""
    with grammar.state(model) as state:
        if state.is_complete:
            return
        try:
            state.allowed()
        except lcgen.GrammarTooSlowError:
            raise
        except lcgen.GrammarError as exc:
            raise APIError(400, str(exc), param=field, code="unsatisfiable_constraints") from None


def _failure(exc: BaseException) -> APIError:
    """The answer to a job's failure (or a submission the stopped engine refused)."""
    if isinstance(exc, lcgen.ContextFullError):  # the cells ran out as the choices grew
        return APIError(
            503,
            "no free KV cells for this reply: every running choice shares the server's context "
            "(lcgen serve --n-ctx), and together they filled it; retry, or ask for fewer "
            "tokens (max_tokens, n)",
            type="server_error",
            code="context_full",
        )
    if isinstance(exc, lcgen.ClosedError):  # the engine stopped: the server is stopping
        return APIError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, lcgen.GrammarTooSlowError):  # a mask past the bound, mid-reply
        return APIError(400, str(exc), code="grammar_too_slow")
    if isinstance(exc, lcgen.GrammarError | lcgen.NoCandidatesError):
        # the request's own constraints (grammar, schema, bans) left no token to generate
        return APIError(400, str(exc), code="unsatisfiable_constraints")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")


async def _cancel_on_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Cancel the job when the client goes away (the body is read: the next message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.cancel(job)
            return


# the application ---------------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, a method a route does not take) in OpenAI's
    shape: what its API says for them, with no code."""
    assert isinstance(exc, HTTPException)
    message = exc.detail
    if exc.status_code in (404, 405):
        message = f"Invalid URL ({request.method} {request.url.path})"
    error = APIError(exc.status_code, message)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """A client that went away while it sent its request: nobody reads a reply (the server
    drops what is sent to a closed connection); without this handler, Starlette's 500 came
    with a traceback in the log."""
    return Response(status_code=400)


async def _server_error(request: Request, exc: Exception) -> Response:
    error = APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(
    model: lcgen.Model,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    draft_model: lcgen.Model | None = None,
    cors_origins: Sequence[str] = (),
) -> Starlette:
    """The ASGI application serving ``model`` (run it with uvicorn; see :func:`serve`).

    Args:
        model: the loaded model; the caller closes it after the application stops.
        model_name: the name clients use (default: the file name).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_queue: the most choices that may wait for a slot; more get 429.
        max_body_bytes: the largest request body; larger ones get 413.
        draft_model: a model of the same vocabulary that drafts for requests asking for
            ``speculate: "draft"`` (the caller closes it too).
        cors_origins: web origins (``https://host:port``, or ``*`` for any) whose pages may
            call the API from a browser (CORS); none by default: a page on another site the
            user visits cannot read the replies.

    Raises:
        ValueError: the draft model cannot draft for ``model`` (another vocabulary, or
            ``model`` itself); ``api_key`` is empty.
    """
    check_api_key(api_key)
    cors_origins = check_cors_origins(cors_origins)
    if draft_model is not None:
        lcgen.check_draft_model(model, draft_model)
    engine = Engine(model, max_queue=max_queue)
    server = _Server(
        model, model_name or model.path.name, engine, api_key, max_body_bytes, draft_model
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.close)

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        APIError: _api_error,
        HTTPException: _http_error,
        ClientDisconnect: _client_gone,
        Exception: _server_error,
    }
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{name:path}", server.one_model, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
        ],
        exception_handlers=handlers,
        lifespan=lifespan,
        middleware=[
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        ]
        if cors_origins
        else [],
    )
    # A path with a slash at the end is a 404 in OpenAI's shape, not a bare redirect (a POST
    # redirected loses its body with some clients); /v1/models/ is the list.
    app.router.redirect_slashes = False
    app.state.engine = engine  # lcgen.server.serve stops its requests as the server stops
    return app
