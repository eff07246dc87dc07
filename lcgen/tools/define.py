"""Tools as values: :class:`Tool` (a function's name, description and JSON Schema parameters),
made from a Python function, a pydantic model class or OpenAI's tool dict, and running a call
of it; the list a chat takes, and which of its functions ``tool_choice`` lets a reply call."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, cast

from lcgen.decoding.options import shown
from lcgen.decoding.results import ToolCall, _validated

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODES = ("auto", "required", "none")
_FUNCTION_KEYS = frozenset(["name", "description", "parameters", "strict"])


@dataclass(frozen=True, slots=True)
class Tool:
    """A function a chat reply may call.

    Attributes:
        name: how calls name it: 1 to 64 ASCII letters, digits, ``_`` or ``-``.
        parameters: the JSON Schema of its arguments, which are always a JSON object (None:
            it takes none).
        description: what it does, told to the model.
        function: what :meth:`invoke` runs: the Python function or pydantic model class the
            tool was made from (None: made from a dict; give one to invoke it). Tools that
            differ only in it are equal.

    Raises:
        ValueError: a name of other characters, empty, or longer than 64.
        TypeError: a name or description that is not a str, parameters that are not a
            mapping, or a function that is not callable.
    """

    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a tool's name is a str, got {shown(self.name)}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"the tool name {self.name!r} is not 1 to 64 ASCII letters, digits, '_' or '-'"
            )
        if self.parameters is not None:
            if not isinstance(self.parameters, Mapping):
                raise TypeError(
                    f"the parameters of tool {self.name!r} are a JSON Schema (a dict), got "
                    f"{shown(self.parameters)}"
                )
            object.__setattr__(self, "parameters", dict(self.parameters))
        if self.description is not None and not isinstance(self.description, str):
            raise TypeError(
                f"the description of tool {self.name!r} is a str, got {shown(self.description)}"
            )
        if self.function is not None and not callable(self.function):
            raise TypeError(
                f"the function of tool {self.name!r} is a callable, got {shown(self.function)}"
            )

    @classmethod
    def of(cls, obj: ToolLike) -> Tool:
        """``obj`` as a Tool.

        Args:
            obj: a Tool (returned as is); a Python function (its ``__name__``, its
                docstring's first paragraph, the JSON Schema of its signature: pydantic reads
                defaults, ``Literal``, ``Annotated[..., Field(description=...)]``); a pydantic
                model class (its name, docstring and schema); or OpenAI's tool dict
                ``{"type": "function", "function": {"name", "description", "parameters"}}``.

        Raises:
            TypeError: anything else (named), a function with ``*args``, ``**kwargs`` or
                positional-only parameters, or with parameters that have no JSON Schema.
            ValueError: a name that is not a tool's (see :class:`Tool`).
        """
        if isinstance(obj, Tool):
            return obj
        if isinstance(obj, Mapping):
            return _of_dict(obj)
        if isinstance(obj, type):
            return _of_model(obj)
        if callable(obj):
            return _of_function(obj)
        raise TypeError(f"{_KINDS}, got {shown(obj)}")

    def invoke(self, call: ToolCall) -> Any:
        """Run a call of this tool: its :attr:`function` with the call's arguments validated by
        pydantic, as its parameters' Python types (a nested model as its instance, a date as a
        ``date``); for a tool made from a pydantic model class, the validated instance.

        ::

            weather = lcgen.Tool.of(get_weather)
            reply = model.chat(messages, tools=[weather])
            results = [weather.invoke(call) for call in reply.tool_calls]

        Args:
            call: a call of this tool (from a reply's ``tool_calls``).

        Returns:
            What the function returns; for a pydantic model class, its instance.

        Raises:
            ValueError: the call names another function.
            TypeError: the tool has no function (it was made from a dict).
            SchemaValidationError: pydantic's validation refused the arguments: it checks more
                than their JSON Schema says, which the grammar cannot enforce.
            (and what the function raises)
        """
        if not isinstance(call, ToolCall):
            raise TypeError(
                f"invoke takes a ToolCall (from a reply's tool_calls), got {call!r:.60}"
            )
        if call.name != self.name:
            raise ValueError(f"the call {call.id} is of function {call.name!r}, not {self.name!r}")
        fn = self.function
        if fn is None:
            raise TypeError(
                f"tool {self.name!r} has no function to invoke (it was made from a dict): make "
                "it from one, or give Tool(..., function=...)"
            )
        # Validated as JSON, as the grammar wrote it: strict types (a strict date, enum, UUID,
        # tuple) take their JSON forms there, and refuse them as Python values.
        text = json.dumps(call.arguments, ensure_ascii=False)
        model_validate = getattr(fn, "model_validate_json", None)
        if model_validate is not None:  # a pydantic model class: its instance
            return _validated(model_validate, text, text, fn, call.id)
        import pydantic

        adapter = pydantic.TypeAdapter(cast(Any, _arguments(fn)))
        arguments = _validated(adapter.validate_json, text, text, fn, call.id)
        return fn(**arguments)

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's tool dict."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# What a chat's ``tools`` list holds: a Tool, a function, a pydantic model class or OpenAI's
# tool dict ({"type": "function", "function": {...}}).
ToolLike = Tool | Callable[..., Any] | type[Any] | Mapping[str, Any]

_KINDS = (
    "a tool is a Python function, a pydantic model class, an OpenAI tool dict "
    "({'type': 'function', 'function': {'name': ...}}) or an lcgen.Tool"
)


def _of_dict(spec: Mapping[str, Any]) -> Tool:
    function = spec.get("function")
    if spec.get("type") != "function" or set(spec) != {"type", "function"}:
        raise TypeError(f"{_KINDS}, got the dict {shown(spec)}")
    if not isinstance(function, Mapping):
        raise TypeError(f"a tool dict's 'function' is a dict, got {shown(function)}")
    unknown = sorted(map(str, set(function) - _FUNCTION_KEYS))
    if unknown:
        raise TypeError(
            f"the tool dict {shown(spec)} has unknown function keys {unknown}: it takes "
            f"{sorted(_FUNCTION_KEYS)}"
        )
    name: Any = function.get("name")  # Tool checks its fields' types
    return Tool(name, function.get("parameters"), function.get("description"))


def _of_model(model: type[Any]) -> Tool:
    """A pydantic model class as a tool: its schema's title (the class name) and description
    (its docstring) become the tool's name and description."""
    import pydantic

    if not issubclass(model, pydantic.BaseModel):
        raise TypeError(f"{_KINDS}, got the class {model.__qualname__} (not a pydantic model)")
    try:
        told, _ = _schemas(model)
    except pydantic.PydanticUserError as exc:
        raise TypeError(f"the pydantic model {model.__name__} has no JSON Schema: {exc}") from None
    description = model.model_json_schema().get("description")
    return Tool(model.__name__, copy.deepcopy(told), description, model)


def _of_function(fn: Callable[..., Any]) -> Tool:
    """A Python function as a tool: its parameters (by name, as a call's arguments are
    passed: ``fn(**call.arguments)``) as pydantic's JSON Schema; ``fn`` runs its calls."""
    import pydantic

    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"{_KINDS}, got {shown(fn)} (a callable without a __name__)")
    _check_signature(fn, name)
    try:
        told, _ = _schemas(fn)
    except (pydantic.PydanticUserError, pydantic.errors.PydanticUndefinedAnnotation) as exc:
        raise TypeError(f"the parameters of function {name!r} have no JSON Schema: {exc}") from None
    doc = inspect.getdoc(fn)
    description = doc.split("\n\n", 1)[0].strip() if doc else ""
    return Tool(name, copy.deepcopy(told), description or None, fn)


def checked_parameters(tool: Tool) -> dict[str, Any] | None:
    """For a tool of a function or a pydantic model whose parameters are still pydantic's,
    the schema of what pydantic checks beyond the one it writes (see
    :mod:`lcgen.constrain.pydantic_schema`: a Decimal's places, a ``dict[int, ...]``'s keys;
    it may hold lcgen's own formats, so the model is told ``parameters``), as ``schema=``
    reads a model; None for any other tool (its parameters are held to as they are)."""
    import pydantic

    fn = tool.function
    if fn is None or tool.parameters is None:
        return None
    try:
        told, checked = _schemas(fn)
    except (TypeError, pydantic.PydanticUserError, pydantic.errors.PydanticUndefinedAnnotation):
        return None  # (a function given to a tool made otherwise)
    return copy.deepcopy(checked) if told == tool.parameters else None


def _schemas(fn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """pydantic's schema of a model's or a function's arguments, and the one of what pydantic
    checks (computed once per function or model)."""
    cached = _model_schemas if isinstance(fn, type) else _function_schemas
    try:
        return cached(fn)
    except TypeError:  # a callable that cannot be hashed: not cached
        return cached.__wrapped__(fn)


@functools.lru_cache(maxsize=128)
def _model_schemas(model: type[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """pydantic's schema of ``model`` and the one of what it checks, each closed."""
    from lcgen.constrain.pydantic_schema import pydantic_schema

    checked = _stripped(pydantic_schema(model))  # (first: it names what has no schema)
    return _stripped(model.model_json_schema()), checked


@functools.lru_cache(maxsize=128)
def _function_schemas(fn: Callable[..., Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """pydantic's schema of ``fn``'s arguments and the one of what it checks, each closed."""
    import pydantic

    from lcgen.constrain.pydantic_schema import adapter_schema

    adapter = pydantic.TypeAdapter(cast(Any, _arguments(fn)))
    checked = _stripped(adapter_schema(adapter))  # (first: it names what has no schema)
    return _stripped(adapter.json_schema()), checked


def _stripped(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = _closed(
        {k: v for k, v in schema.items() if k not in ("title", "description")}
    )
    return out


# Keywords whose value maps names to schemas, and keywords whose value is JSON data (the
# others hold a schema or a list of them).
_SCHEMA_MAPS = frozenset(["properties", "patternProperties", "$defs", "definitions"])
_DATA = frozenset(["default", "const", "enum", "examples"])


def _closed(schema: Any) -> Any:
    """Pydantic's ``schema`` with each object that declares properties and says nothing of
    others closed to them, as ``schema=`` reads a pydantic model: pydantic's default
    ``extra="ignore"`` and ``"forbid"`` take no other keys (``"allow"`` says
    ``additionalProperties: true``), so arguments never fill with keys the function lacks."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value
        if key in _DATA
        else {k: _closed(v) for k, v in value.items()}
        if key in _SCHEMA_MAPS and isinstance(value, dict)
        else _closed(value)
        for key, value in schema.items()
    }
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _arguments(fn: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """A stand-in of ``fn``'s signature that returns its arguments (for pydantic to describe
    and validate them without calling ``fn``), its annotations read in ``fn``'s own globals
    where they are text (``from __future__ import annotations``): pydantic reads them in the
    module's, which code run by ``exec`` (a notebook cell, a snippet) may not have."""
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unreadable here too: pydantic says why
        hints = dict(getattr(fn, "__annotations__", {}))
    params = [
        p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
    ]

    def arguments(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    arguments.__name__ = arguments.__qualname__ = fn.__name__
    arguments.__module__ = getattr(fn, "__module__", None) or arguments.__module__
    arguments.__annotations__ = hints
    arguments.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=hints.get("return", signature.return_annotation)
    )
    return arguments


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    """Refuse parameters a call cannot name: ``*args``, ``**kwargs``, positional-only."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise TypeError(f"the signature of function {name!r} cannot be read") from None
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise TypeError(
                f"function {name!r} takes {star}{param.name}: a tool's arguments are named in "
                "its JSON Schema, so give each parameter its own name"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(
                f"function {name!r} has the positional-only parameter {param.name!r}: a call "
                "passes its arguments by name"
            )


def tool_list(tools: object) -> list[Tool]:
    """A chat's ``tools`` as Tools (see :meth:`Tool.of`).

    Raises:
        TypeError: not a list, or an item that is not a tool (named).
        ValueError: two tools with one name, or a bad name (named).
    """
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Iterable):
        hint = " (one tool: tools=[it])" if callable(tools) or isinstance(tools, Mapping) else ""
        raise TypeError(f"tools takes a list of tools, got {shown(tools)}{hint}")
    out = [Tool.of(item) for item in tools]
    seen: set[str] = set()
    for tool in out:
        if tool.name in seen:
            raise ValueError(f"two tools are named {tool.name!r}: a call names its function")
        seen.add(tool.name)
    return out


def active(tools: Seq[Tool], tool_choice: object = "auto") -> tuple[list[Tool], bool]:
    """The tools a reply may call, and whether it must call one.

    Args:
        tools: the chat's tools.
        tool_choice: ``"auto"`` (calls or text), ``"required"`` (calls), ``"none"`` (no
            calls: none of the tools), a function's name or OpenAI's
            ``{"type": "function", "function": {"name": ...}}`` (calls of that one).

    Raises:
        TypeError: a tool_choice of another shape.
        ValueError: the named function is not among the tools, or ``"required"`` without
            tools.
    """
    name = _named(tool_choice)
    if name is not None:
        named = [t for t in tools if t.name == name]
        if not named:
            names = [t.name for t in tools]
            raise ValueError(f"tool_choice names {name!r}, which is not in tools {names}")
        return named, True
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools, got none")
    if tool_choice == "none":
        return [], False
    return list(tools), tool_choice == "required"


def _named(tool_choice: object) -> str | None:
    """The function ``tool_choice`` names; None for ``"auto"``, ``"required"``, ``"none"``.

    Raises:
        TypeError: a value of another shape.
    """
    if isinstance(tool_choice, str):
        return None if tool_choice in _MODES else tool_choice
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise TypeError(
        "tool_choice is 'auto', 'required', 'none', a function's name or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {shown(tool_choice)}"
    )
