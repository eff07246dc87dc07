"""Function calling: ``model.chat(messages, tools=[...])``, with calls that always parse.

::

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        ...  # its docstring's first paragraph tells the model what it does

    weather = lcgen.Tool.of(get_weather)
    reply = model.chat(messages, tools=[weather])
    for call in reply.tool_calls:       # lcgen.ToolCall(id, name, arguments: dict)
        result = weather.invoke(call)   # get_weather, its arguments validated by pydantic

A tool is a Python function, a pydantic model class, OpenAI's tool dict or an
:class:`~lcgen.Tool` (:meth:`Tool.of` converts). The model is told the functions in the
system message and asked to call one by replying with only ``{"name": ..., "arguments": ...}``,
or several at once with a JSON array of those (unless ``parallel_tool_calls`` is false). The
reply is constrained so that every call is valid: with ``tool_choice`` ``"required"`` or a
function's name it must be calls whose arguments validate against their function's
``parameters``; with ``"auto"`` it is either such calls (a reply that starts with ``{``, or
``[`` for several) or text that starts with neither. A reply that is calls comes back as a
:class:`~lcgen.Text` ``""`` with the calls in ``tool_calls`` and ``finish_reason``
``"tool_calls"``; ``model.chat_stream`` streams no text for it and gives the calls in its last
:class:`~lcgen.Chunk`'s ``tool_calls``. :meth:`Tool.invoke` runs a call (a pydantic model
class's tool: makes the validated instance). The server's ``response_format`` can shape the
reply that is not calls instead (JSON text valid for its schema).

Earlier turns go back into the prompt as messages of OpenAI's shapes (an assistant message
with ``tool_calls``, a ``"tool"`` message with ``tool_call_id``), written as text: an
assistant's calls as that JSON, a tool's result as a user message naming the function. The
functions are told in the system message, so a chat's turns share the prompt's start (the KV
cache keeps it).
"""

from lcgen.decoding.results import ToolCall
from lcgen.tools.define import Tool, ToolLike, active, tool_list
from lcgen.tools.messages import check_messages, instructions, prompt_messages
from lcgen.tools.plan import ToolPlan, check_options, make_tool_plan
from lcgen.tools.schema import MAX_PARALLEL, calls_schema, grammar, parse_calls, starts_call

__all__ = [
    "MAX_PARALLEL",
    "Tool",
    "ToolCall",
    "ToolLike",
    "ToolPlan",
    "active",
    "calls_schema",
    "check_messages",
    "check_options",
    "grammar",
    "instructions",
    "make_tool_plan",
    "parse_calls",
    "prompt_messages",
    "starts_call",
    "tool_list",
]
