"""Tool calls of `/v1/chat/completions`, in one documented format for every model.

The functions go to the model in a system message (after any system message of the request), with the
instruction to call one by answering

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(earlier calls in the conversation are rendered the same way). tool_choice:
- "auto" (the default with tools): the answer is read for such blocks; the text before them is the
  message's content, and finish_reason is "tool_calls" when there is at least one valid call.
- "required" or a named function: a grammar (a JSON schema: `{"name": <one of the functions>,
  "arguments": <its parameters>}`) makes the whole answer one call, always valid.
- "none": the functions are not shown and the answer is plain content."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_errors import OpenAIError

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_INSTRUCTIONS = (
    "You can call functions. To call one, answer with only\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
    "The functions:\n"
)


@dataclass
class ToolPlan:
    functions: list[dict[str, Any]]  # OpenAI's function specs: name, description, parameters
    choice: str  # "auto", "required" or a function's name
    schema: str | None  # the JSON schema the answer follows (required / named), else None
    # the tag after which that schema applies (a model that reasons first: require_reasoning), when the
    # reasoning stays in the text (separate_reasoning: false); None: from the start
    after: str | None = None

    def add_to(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        text = _INSTRUCTIONS + "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions)
        at = 1 if messages and messages[0]["role"] == "system" else 0
        if at:
            first = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            return [first, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer as (content, tool calls); content None when the answer is only calls."""
        names = {f["name"] for f in self.functions}
        if self.schema is not None:  # the grammar made it one call (cut short: left as content)
            head, answer = "", text
            if self.after is not None and self.after in text:  # the reasoning before it stays content
                head, _, answer = text.partition(self.after)
                head += self.after
            call = _call(answer, names)
            return (head or None, [call]) if call is not None else (text, [])
        calls = [c for c in (_call(m.group(1), names) for m in _BLOCK.finditer(text)) if c is not None]
        if not calls:
            return text, []
        head = text[: text.index("<tool_call>")].strip()
        return head or None, calls


def plan_tools(tools: Any, choice: Any) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none"."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list of {type: function, function: {...}}", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise OpenAIError("tools have two functions of the same name", "tools")
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto", None)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(functions, "required", _schema(functions))
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise OpenAIError(
            f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice"
        )
    return ToolPlan(functions, name, _schema([f for f in functions if f["name"] == name]))


def tool_calls_text(calls: Any, i: int) -> str:
    """An assistant message's earlier tool_calls, as the model is asked to write them."""
    if not isinstance(calls, list):
        raise OpenAIError(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(f"messages[{i}].tool_calls has a call without function.name", "messages")
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise OpenAIError(
                f"messages[{i}].tool_calls has arguments that are not JSON", "messages"
            ) from None
        out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>")
    return "\n".join(out)


def _function(tool: Any, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise OpenAIError(
            f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}", "tools"
        )
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    out = {"name": fn["name"], "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


def _schema(functions: list[dict[str, Any]]) -> str:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def _call(text: str, names: set[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }
