"""Request bodies, parsed with pydantic (strict types, unknown fields refused), and made into
lcgen's generation options once, at the edge.

The OpenAI fields are named as OpenAI names them; lcgen's own controls are extra top-level
fields (``extra_body`` in the official client): ``banned``, ``banned_ignore_case``,
``max_retries``, ``grammar`` (GBNF text, or the name of a bundled grammar), ``regex``,
``choice``, ``token_healing``, ``top_k``, ``min_p``, ``repeat_penalty``, ``speculate``
(``"ngram"``, or ``"draft"`` on a server started with a draft model), ``num_draft``,
``fast_forward``. Nothing in a request names a file on the server.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import lcgen
import lcgen.tools
from lcgen.server import tools as tooling
from lcgen.server.tools import Tool, ToolCall, ToolChoice

MAX_STOPS = 16
MAX_N = 128  # as OpenAI's API
MAX_TOP_LOGPROBS = 20
MAX_LIST = 1024  # banned phrases, choice options, prompts in one request


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    # No NaN or infinity (pydantic's JSON reader takes them): a bound such as temperature <= 2
    # said a NaN was over it; "a finite number" says what is wrong.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"unsupported content part type {kind!r}: lcgen takes text parts")
        return data


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=tooling.MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    # A reply message as the client dumps it (``message.model_dump()``) carries these, empty.
    refusal: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None
    parsed: Any = Field(None, exclude=True)  # the client's parse helpers add it; ignored

    @model_validator(mode="after")
    def _check(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return self

    def as_dict(self) -> dict[str, Any]:
        text = self.content or ""
        if not isinstance(text, str):
            text = "".join(part.text for part in text)
        # The chat templates know "system"; "developer" is OpenAI's newer name for it.
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:  # the chat template's to write (many write no names)
            out["name"] = self.name
        return out


class JsonSchemaFormat(_Strict):
    name: str = "output"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False  # (null: the default)
    include_obfuscation: bool | None = None  # accepted; a local server pads nothing


Probability = Annotated[float, Field(ge=0.0, le=1.0)]


# Fields OpenAI's API declares nullable with a default: null means the default (clients and
# proxies send unset options as null).
_NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "echo"})


class _Common(_Strict):
    """The fields both endpoints take."""

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
        return data

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # OpenAI's int64
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    # lcgen's controls
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Probability | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0)] | None = None
    banned: Annotated[list[str], Field(max_length=MAX_LIST)] | None = None
    banned_ignore_case: bool = False
    max_retries: Annotated[int, Field(ge=0, le=10_000)] | None = None
    grammar: str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_LIST)] | None = None
    token_healing: bool = False
    speculate: Literal["ngram", "draft"] | None = None
    num_draft: Annotated[int, Field(ge=1, le=64)] | None = None
    fast_forward: bool = True

    @field_validator("seed")
    @classmethod
    def _unsigned(cls, seed: int | None) -> int | None:
        """A negative seed (OpenAI's are int64; clients send -1) as the same 64 bits."""
        return None if seed is None else seed % 2**64

    @model_validator(mode="after")
    def _stream_options(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI's API)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=tooling.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true (as OpenAI's API)")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        return self

    def callable_tools(self) -> list[lcgen.Tool]:
        """The tools this reply may call (see :func:`lcgen.server.tools.active`).

        Raises:
            APIError: 400, two tools share a name, or ``tool_choice`` names a function not in
                ``tools``.
        """
        listed = _checked("tools", lambda: tooling.listed(self.tools))
        try:
            return tooling.active(listed, self.tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None

    @property
    def tool_required(self) -> bool:
        return self.tool_choice is not None and self.tool_choice not in ("auto", "none")

    @property
    def tool_parallel(self) -> bool:
        """Whether the reply may call several functions (OpenAI's default: yes)."""
        return self.parallel_tool_calls is not False


class CompletionRequest(_Common):
    # text, several texts, token ids, or several lists of token ids (as OpenAI's API takes)
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_N)
        ]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    # 0 with echo: the prompt's log-probabilities alone (scoring, as evaluation harnesses do).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    # Fill in the middle: the completion is the text between the prompt and the suffix.
    suffix: str | None = None
    # OpenAI's: generate best_of and return the n most likely; taken where it is n (clients
    # send best_of 1).
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is for echo (the prompt scored)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of {self.best_of} with n {self.n}: lcgen returns every choice it "
                "generates, so best_of can only be n (leave it out, or ask for n choices)"
            )
        if self.echo and self.suffix is not None:
            raise ValueError("echo cannot be used with suffix (the prompt is not text then)")
        return self


R = TypeVar("R", bound=_Strict)


def parse(cls: type[R], body: bytes) -> R:
    """The request in ``body`` (JSON), checked.

    Raises:
        APIError: 400, naming the first field that is wrong (or saying the JSON is malformed).
    """
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            message = errors[0]["msg"]
            # (a lone UTF-16 surrogate, "\ud800", is no character)
            if "hex escape" in message or "surrogate" in message:
                message += (
                    " (a \\u escape is 4 hex digits, and one of a surrogate pair, \\ud800 to "
                    "\\udfff, needs the other: JSON text is Unicode characters)"
                )
            raise APIError(400, f"the body is not valid JSON: {message}") from None
        # A union's members each report an error: those that only say the input is not of
        # the member's type explain least, then type errors inside a member; the same error
        # of several members is one.
        tier = min(map(_tier, errors))
        telling: dict[tuple[tuple[str, ...], str], Any] = {}
        for error in errors:
            if _tier(error) == tier:
                telling.setdefault((_path(error), error["msg"]), error)
        first = next(iter(telling.values()))
        message = first["msg"].removeprefix("Value error, ")
        path = _path(first)
        param = ".".join(path) or field_named(message, cls)
        more = f" (and {len(telling) - 1} more)" if len(telling) > 1 else ""
        where = f"{param}: " if path else ""
        raise APIError(400, f"{where}{message}{more}", param=param) from None


# pydantic's errors that say only that a value is not of a type
_TYPE_ERRORS = frozenset(
    [
        "string_type",
        "int_type",
        "float_type",
        "bool_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "literal_error",
        "none_required",
        "is_instance_of",
    ]
)


def _tier(error: Any) -> int:
    """How well an error explains the input: 0 an error outside any union, or not about a
    type; 1 a type error inside a union's member; 2 the input is not of a member's type
    (the error's path ends at the member's tag)."""
    loc = error["loc"]
    if error["type"] not in _TYPE_ERRORS or not any(map(_union_tag, loc)):
        return 0
    return 2 if _union_tag(loc[-1]) else 1


def _path(error: Any) -> tuple[str, ...]:
    """pydantic's path, less the tags it adds for a union's members (``str``, ``list[...]``)."""
    return tuple(str(part) for part in error["loc"] if not _union_tag(part))


def _union_tag(part: int | str) -> bool:
    # (``str``, ``list[str]``, ``literal['none','auto']``, or a model's name: fields are
    # lower case)
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool"} or "[" in part or part[:1].isupper()
    )


def field_named(message: str, cls: type[BaseModel], given: Iterable[str] = ()) -> str | None:
    """The request field an error is about (a whole-request check's, an option's): lcgen's
    messages start with the field's name, or else name (as a word) one of the fields
    ``given`` (those the request set)."""
    name = re.match(r"[a-z_]+", message)
    if name and name.group() in cls.model_fields:
        return name.group()
    given = set(given)
    return next((w for w in re.findall(r"[a-z_]+", message) if w in given), None)


# lcgen's options ---------------------------------------------------------------------------
def options(
    req: ChatRequest | CompletionRequest, n_vocab: int, draft: lcgen.Model | None = None
) -> dict[str, Any]:
    """The generation options of a request (max_tokens is set by the caller); ``draft`` is
    the server's draft model, for ``speculate: "draft"``.

    Raises:
        APIError: 400 for a constraint that does not compile, a bad token id, or a draft
            model asked of a server without one (named).
    """
    out: dict[str, Any] = {
        "stop": req.stop,
        "seed": req.seed,
        # OpenAI's default temperature is 1; 0 is greedy.
        "temperature": 1.0 if req.temperature is None else req.temperature,
        # top_p 0 (OpenAI allows it) keeps the most likely token alone.
        "top_p": req.top_p or None,
        "top_k": 1 if req.top_p == 0 else req.top_k,
        "min_p": req.min_p,
        "repeat_penalty": req.repeat_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "token_healing": req.token_healing,
        "fast_forward": req.fast_forward,
        "logprobs": n_logprobs(req),
        "logit_bias": _logit_bias(req.logit_bias, n_vocab),
        **_constraint(req),
    }
    if req.speculate == "draft" and draft is None:
        raise APIError(
            400,
            "speculate: this server has no draft model (start it with --draft MODEL), "
            "or use 'ngram'",
            param="speculate",
        )
    if req.num_draft is not None and req.speculate is None:
        raise APIError(400, "num_draft needs speculate ('ngram' or 'draft')", param="num_draft")
    if req.banned_ignore_case and req.banned is None:  # without phrases it would do nothing
        raise APIError(
            400, "banned_ignore_case needs banned (a list of phrases)", param="banned_ignore_case"
        )
    if req.max_retries is not None and req.banned is None and not _has_schema(req):
        raise APIError(
            400,
            "max_retries needs banned (a list of phrases) or a JSON Schema (a json_schema "
            "response_format or tools: their uniqueItems retry too)",
            param="max_retries",
        )
    if req.speculate is not None:
        out["speculate"] = draft if req.speculate == "draft" else req.speculate
        if req.num_draft is not None:
            out["num_draft"] = req.num_draft
    if req.banned:
        out.update(banned=req.banned, banned_ignore_case=req.banned_ignore_case)
    if req.max_retries is not None:
        out["max_retries"] = req.max_retries
    return out


def max_tokens(req: ChatRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def n_logprobs(req: ChatRequest | CompletionRequest) -> int | None:
    """How many alternatives to report per token; None: no log-probabilities."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _logit_bias(bias: dict[str, float] | None, n_vocab: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # Leading zeros dropped before int(): it refuses a string of over 4,300 digits.
        digits = key.lstrip("0") or "0"
        if not (key.isascii() and key.isdigit()) or len(digits) > 12 or int(digits) >= n_vocab:
            raise APIError(
                400,
                f"logit_bias: {key!r} is not a token id of this model (0 to {n_vocab - 1})",
                param="logit_bias",
            )
        out[int(digits)] = value
    return out


def _constraint(req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The one constraint given (response_format, grammar, regex or choice) as a grammar;
    tools may come with a response_format (it shapes a reply that is not calls)."""
    given = _given_constraints(req)
    names = [name for name, _ in given]
    if len(given) > 1 and names != ["tools", "response_format"]:
        raise APIError(400, f"give at most one constraint; got {names}", param=names[1])
    if not given:
        return {}
    if len(given) > 1:  # tools: calls, or JSON text of the response_format
        schema = _checked("response_format", lambda: _format_fallback(*given[1][1])[0])
        value = (*given[0][1], schema)
        return {"grammar": _checked("tools", lambda: lcgen.tools.grammar(*value))}
    name, value = given[0]
    return {"grammar": _checked(name, lambda: _compile(name, value))}


def constraint_field(req: ChatRequest | CompletionRequest) -> str | None:
    """The field the request's constraint comes from (tools, where a response_format comes
    with them); None without one."""
    given = _given_constraints(req)
    return given[0][0] if given else None


def _has_schema(req: ChatRequest | CompletionRequest) -> bool:
    """Whether the request's constraint is a JSON Schema (tools, a json_schema response_format),
    whose ``uniqueItems`` may use retries."""
    field = constraint_field(req)
    if field == "response_format":
        fmt = req.response_format if isinstance(req, ChatRequest) else None
        return fmt is not None and fmt.type == "json_schema"
    return field == "tools"


def _given_constraints(req: ChatRequest | CompletionRequest) -> list[tuple[str, Any]]:
    """The constraint fields the request set, with their values, in a fixed order."""
    callable_tools, required, parallel = [], False, False
    if isinstance(req, ChatRequest):
        callable_tools, required, parallel = (
            req.callable_tools(),
            req.tool_required,
            req.tool_parallel,
        )
    return [
        (name, value)
        for name, value in (
            ("tools", (callable_tools, required, parallel) if callable_tools else None),
            ("response_format", _format_schema(req)),
            ("grammar", req.grammar),
            ("regex", req.regex),
            ("choice", req.choice),
        )
        if value is not None
    ]


T = TypeVar("T")


def _checked(name: str, make: Callable[[], T]) -> T:
    """``make()``; its errors are 400s naming the field ``name``."""
    try:
        return make()
    except (lcgen.GrammarError, ValueError, TypeError) as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from None


def _compile(name: str, value: Any) -> lcgen.Grammar:
    if name == "tools":
        return lcgen.tools.grammar(*value)
    if name == "grammar":
        if "::=" in value:
            return lcgen.Grammar(value)
        try:
            return lcgen.Grammar.bundled(value)
        except ValueError as exc:
            raise ValueError(f"not GBNF text (no '::='), and {exc}") from None
    if name == "regex":
        return lcgen.Grammar.regex(value)
    if name == "choice":
        return lcgen.Grammar.choice(value)
    return _format_fallback(*value)[1]


def _format_fallback(schema: Any, strict: bool) -> tuple[Any, lcgen.Grammar]:
    """A response_format's JSON Schema, and its grammar: the schema's own, or not strict
    (best effort) for a schema lcgen cannot enforce, a JSON value of the type the schema
    names (an object where it names none), with that type's schema.

    Raises:
        lcgen.GrammarError: the schema is invalid, no value validates it, or it is strict
            and unsupported.
    """
    try:
        return schema, lcgen.Grammar.from_json_schema(schema)
    except lcgen.UnsupportedSchemaError:
        # Not strict falls back for a schema lcgen cannot enforce, never for an invalid one
        # or one no value validates.
        if strict:
            raise
        named = schema.get("type") if isinstance(schema, dict) else None
        kinds = [named] if isinstance(named, str) else named
        if not isinstance(kinds, list) or not kinds or not set(kinds) <= _JSON_TYPES:
            kinds = ["object"]
        fallback = {"type": kinds}
        return fallback, lcgen.Grammar.from_json_schema(fallback)


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _format_schema(req: ChatRequest | CompletionRequest) -> tuple[Any, bool] | None:
    """response_format as (JSON Schema, strict), or None for plain text."""
    fmt = getattr(req, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}, True
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format: type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return fmt.json_schema.schema_, bool(fmt.json_schema.strict)


def check_api_key(api_key: str | None) -> str | None:
    """``api_key`` when it is None (no authentication) or a key that is not blank.

    Raises:
        ValueError: it is blank (any client could send it).
    """
    if api_key is not None and not api_key.strip():
        raise ValueError(
            f"api_key={api_key!r} is blank: any client could send it; give a key, or None "
            "for a server without authentication"
        )
    return api_key


_ORIGIN = re.compile(r"https?://[^/\s?#]+")


def check_cors_origins(origins: Iterable[str]) -> list[str]:
    """``origins`` as a list, each ``*`` or a web origin: ``http(s)://host[:port]``, nothing
    after it (a browser sends exactly that; anything else would never match).

    Raises:
        ValueError: naming the first that is not.
    """
    out = list(origins)
    for origin in out:
        if not isinstance(origin, str) or not (origin == "*" or _ORIGIN.fullmatch(origin)):
            raise ValueError(
                f"CORS origin {origin!r} is not '*' or a web origin such as "
                "'https://example.com' or 'http://localhost:3000' (no path, no trailing /)"
            )
    return out
