"""OpenAI's Responses API: ``POST /v1/responses`` (stateless: as vLLM and llama-server serve
it, for the ``openai`` client's ``responses.create`` and agents built on it).

A request is translated onto the chat pipeline (``chat.prepare_chat``): ``instructions``,
``input`` (a string, or items: messages with ``input_text`` / ``input_image`` /
``output_text`` parts, ``function_call`` and ``function_call_output``), ``tools`` (function
tools), ``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (``text``, ``json_object``, ``json_schema``), ``stream``. The
answer's items: ``reasoning`` (the model's ``<think>`` text), a ``message`` with its
``output_text``, ``function_call``\\ s; ``status`` ``incomplete`` when ``max_output_tokens``
cut it. Streamed as the API's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``). Nothing is stored:
``previous_response_id`` and ``store: true`` retrievals are not served (a 400 says so).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch.chat import ChatSetup
from llamabatch.chat.answer import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallHead
from llamabatch.outputs import CompletionOutput
from llamabatch.server.chat import translated_chat
from llamabatch.server.offload import ENCODE, run_step, small_work
from llamabatch.server.protocol import bad_request, generation_error, new_id, now
from llamabatch.server.streaming import EventStream, dumps_json, generate_all, primed, until_disconnect

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer

#: the fields translated; the rest is read as the chat body's own (``temperature``, ``top_p``,
#: ``seed``, ...), or warned about as unknown
_TRANSLATED = (
    "input", "instructions", "max_output_tokens", "tools", "text", "reasoning", "store", "metadata",
    "user", "truncation", "previous_response_id", "include", "background",
)  # fmt: skip


def to_chat_body(data: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request as the equivalent OpenAI chat body (``APIError`` 400 naming the
    field for what it cannot take)."""
    if data.get("previous_response_id") is not None or data.get("background"):
        name = "previous_response_id" if data.get("previous_response_id") is not None else "background"
        raise bad_request(f"'{name}' needs stored responses, which this server does not keep", param=name)
    messages: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = data.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _item(item, f"input[{i}]", messages)
    else:
        raise bad_request("'input' must be a string or a non-empty array of items", param="input")
    body: dict[str, Any] = {k: v for k, v in data.items() if k not in _TRANSLATED}
    body["messages"] = messages
    if data.get("max_output_tokens") is not None:
        body["max_tokens"] = data["max_output_tokens"]
    if "tools" in data:
        tools = data["tools"]
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" for t in tools
        ):
            raise bad_request(
                "'tools' must be function tools ({'type': 'function', 'name', ...})", param="tools"
            )
        body["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    text = data.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "answer"), "schema": fmt.get("schema", {})}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        body["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise bad_request("'text.format' must be {'type': text, json_object or json_schema}", param="text")
    return body


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return {k: tool[k] for k in ("name", "description", "parameters") if k in tool}


def _item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    """One input item onto the chat messages: a function call joins the assistant turn
    before it (or opens one), its output becomes a ``tool`` message."""
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"'{where}.role' must be user, system, developer or assistant", param="input")
        role = "system" if role == "developer" else role
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output", "")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    elif kind != "reasoning":  # (a past answer's reasoning is not sent back to the model)
        raise bad_request(f"'{where}': an item of type {kind!r} is not served", param="input")


def _content(content: Any, where: str) -> Any:
    """A message's content: a string, or its parts as chat content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad_request(f"'{where}[{j}]': a part of type {kind!r} is not served", param="input")
    if all(p["type"] == "text" for p in parts):
        return "".join(str(p["text"]) for p in parts)
    return parts


def _text(parts: Any, where: str) -> str:
    content = _content(parts, where)
    if not isinstance(content, str):
        raise bad_request(f"'{where}' must be text", param="input")
    return content


# -- the handler ---------------------------------------------------------------------------


async def responses(server: OpenAIServer, request: Request) -> Any:
    chat = await translated_chat(server, request, "/v1/responses", to_chat_body)
    raw, llm, prompt, setup, params = chat.data, server.need_llm(), chat.prompt, chat.setup, chat.setup.params
    priority, client = chat.priority, chat.client
    head = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": now(),
        "model": server.model_name,
        "instructions": raw.get("instructions"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tools": raw.get("tools", []),
        "tool_choice": raw.get("tool_choice", "auto"),
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "metadata": raw.get("metadata") or {},
        "error": None,
    }
    if chat.stream:
        gen = await primed(generate_all(llm, [prompt], params, priority, client), request.receive)
        return EventStream(_events(gen, setup, head))
    (result,) = await until_disconnect(
        request.receive, server.collect(llm, [prompt], params, priority, client)
    )
    server.raise_for_errors(result.outputs)
    out = setup.finish_output(result.outputs[0])
    encoded = await run_step(
        request, ENCODE, lambda: dumps_json(_response(head, out)), small=small_work([out.text])
    )
    return Response(encoded, media_type="application/json")


def _items(out: CompletionOutput) -> list[dict[str, Any]]:
    """A split answer's output items."""
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append(_reasoning(new_id("rs"), out.reasoning))
    if out.text or not out.tool_calls:
        items.append(_message(new_id("msg"), out.text, "completed"))
    for call in out.tool_calls:
        items.append(_call(new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


def _reasoning(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _response(
    head: dict[str, Any], out: CompletionOutput, items: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    usage = out.usage
    cut = out.finish_reason == "length"
    return {
        **head,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": _items(out) if items is None else items,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.reused_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
    }


class _Emitter:
    """The stream's events, numbered, and the output items built as they open and close."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps_json(payload) + b"\n\n"

    def begin(self, item: dict[str, Any]) -> list[bytes]:
        events = self.end()
        self.open, self.text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        return events

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def delta(self, text: str) -> bytes:
        assert self.open is not None
        self.text += text
        kind = self.open["type"]
        if kind == "function_call":
            return self.event("response.function_call_arguments.delta", **self._at(), delta=text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return self.event(name, **self._at(), content_index=0, delta=text)

    def end(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        at, text, events = self._at(), self.text, []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            events.append(self.event("response.output_text.done", **at, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **at, content_index=0, part=part))
            item = _message(item["id"], text, "completed")
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **at, arguments=text))
            item = _call(item["id"], item["call_id"], item["name"], text, "completed")
        else:
            events.append(self.event("response.reasoning_text.done", **at, content_index=0, text=text))
            item = _reasoning(item["id"], text)
        events.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        self.items.append(item)
        self.open = None
        return events


async def _events(
    gen: AsyncIterator[tuple[int, Any]], setup: ChatSetup, head: dict[str, Any]
) -> AsyncIterator[bytes]:
    emit = _Emitter()
    started = {**head, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield emit.event("response.created", response=started)
    yield emit.event("response.in_progress", response=started)
    answer = setup.stream()
    async for _, delta in gen:
        out = delta.output
        pieces = answer.feed(delta.text) + (answer.finish(out.finish_reason) if out is not None else [])
        for piece in pieces:
            kind = emit.open["type"] if emit.open is not None else None
            if isinstance(piece, ToolCallHead):
                for event in emit.begin(_call(new_id("fc"), piece.id, piece.name, "", "in_progress")):
                    yield event
                continue
            if isinstance(piece, ReasoningDelta) and kind != "reasoning":
                for event in emit.begin(
                    {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                ):
                    yield event
            elif isinstance(piece, ContentDelta) and kind != "message":
                for event in emit.begin(_message(new_id("msg"), "", "in_progress")):
                    yield event
            assert isinstance(piece, ContentDelta | ReasoningDelta | ToolCallArguments)
            yield emit.delta(piece.arguments if isinstance(piece, ToolCallArguments) else piece.text)
        if out is None:
            continue
        if out.finish_reason == "error":
            error = generation_error(out)
            yield emit.event("error", code=error.code, message=error.message, param=None)
            return
        if not emit.items and emit.open is None:  # an empty answer is an empty message
            for event in emit.begin(_message(new_id("msg"), "", "in_progress")):
                yield event
        for event in emit.end():
            yield event
        done = _response(head, setup.finish_output(out), emit.items)
        yield emit.event(
            "response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done
        )
