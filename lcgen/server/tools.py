"""The HTTP shapes of OpenAI's ``tools``, ``tool_choice`` and an assistant's ``tool_calls``,
made into lcgen's (:mod:`lcgen.tools` is function calling itself: the functions told in the
prompt, the grammar that keeps every call valid, the calls read back).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import lcgen
import lcgen.tools

MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef

    def as_tool(self) -> lcgen.Tool:
        fn = self.function
        return lcgen.Tool(fn.name, fn.parameters, fn.description)


class FunctionName(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    # The client's parse helpers add the arguments parsed; ignored (as OpenAI ignores them).
    parsed_arguments: Any = Field(None, exclude=True)


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = Field(None, exclude=True)  # a streamed call's, as the client keeps it


def listed(tools: list[Tool] | None) -> list[lcgen.Tool]:
    """A request's tools as lcgen's.

    Raises:
        ValueError: two tools share a name.
    """
    return lcgen.tools.tool_list([tool.as_tool() for tool in tools or ()])


def active(tools: list[lcgen.Tool], choice: ToolChoice | None) -> list[lcgen.Tool]:
    """The tools the reply may call: none without tools or with ``tool_choice: "none"``, the
    named one, or all (see :func:`lcgen.tools.active`).

    Raises:
        ValueError: the named function is not among the tools.
    """
    if not tools:
        return []
    given = choice.model_dump() if isinstance(choice, NamedChoice) else choice or "auto"
    return lcgen.tools.active(tools, given)[0]
