"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (as
llama-server serves them, for clients such as Claude Code or the ``anthropic`` SDK).

A request is translated onto the chat pipeline (``chat.prepare_chat``): ``system``, content
blocks (``text``, ``image``, ``thinking``, ``tool_use``, ``tool_result``), ``tools`` with
their ``input_schema``, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``stream``, ``thinking`` (``enabled`` or ``disabled``: the chat
template's ``enable_thinking``, which Qwen3's read). The answer comes back as content blocks:
``thinking`` (the model's reasoning), ``text``, ``tool_use`` (``input``: the call's arguments), with
``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``; streamed, as
Anthropic's events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``). Errors are Anthropic's ``{"type": "error", ...}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch.chat import ChatSetup
from llamabatch.chat.answer import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallHead
from llamabatch.outputs import CompletionOutput
from llamabatch.server.chat import read_chat_request, translated_chat
from llamabatch.server.offload import ENCODE, PREPARE, run_step, small_work
from llamabatch.server.prepare import render_chat_request
from llamabatch.server.protocol import Body, bad_request, generation_error, new_id
from llamabatch.server.streaming import (
    EventStream,
    dumps_json,
    error_response,
    generate_all,
    primed,
    until_disconnect,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer

#: the fields translated; the others (``max_tokens``, ``temperature``, ``stream``, ...) are
#: read as the chat body's own, or warned about as unknown
_TRANSLATED = ("system", "messages", "stop_sequences", "tools", "tool_choice", "thinking")
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_body(data: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as the equivalent OpenAI chat body (``APIError`` 400
    naming the field for a shape it cannot take)."""
    messages: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(raw):
        messages += _messages(message, f"messages[{i}]")
    body: dict[str, Any] = {k: v for k, v in data.items() if k not in _TRANSLATED}
    body["messages"] = messages
    if "max_tokens" not in data:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    if "stop_sequences" in data:
        body["stop"] = data["stop_sequences"]
    if "tools" in data:
        body["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_array(data["tools"], "tools"))]
    choice = data.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (*_TOOL_CHOICE, "tool"):
            raise bad_request("'tool_choice' must be {'type': auto, any, tool or none}", param="tool_choice")
        kind = choice["type"]
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}}
            if kind == "tool"
            else _TOOL_CHOICE[kind]
        )
        if choice.get("disable_parallel_tool_use") is True:
            body["parallel_tool_calls"] = False
    thinking = data.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        # the templates of models that think on request (Qwen3's) read enable_thinking
        kwargs = body.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("enable_thinking", thinking["type"] == "enabled")
        body["chat_template_kwargs"] = kwargs
    elif thinking is not None:
        raise bad_request("'thinking' must be {'type': 'enabled' or 'disabled'}", param="thinking")
    return body


def _array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array", param=where.split("[")[0])
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of an array of ``text`` blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in _array(content, where):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad_request(f"'{where}' holds text blocks only", param=where.split("[")[0])
        parts.append(block["text"])
    return "".join(parts)


def _messages(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: an assistant turn's ``tool_use`` blocks
    become its ``tool_calls``; a user turn's ``tool_result`` blocks become ``tool`` messages
    (before the rest of the turn)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f"'{where}' must have the role 'user' or 'assistant'", param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking = ""
    for j, block in enumerate(_array(content, where)):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text")})
        elif kind == "image":
            parts.append(
                {"type": "image_url", "image_url": {"url": _image_url(block, f"{where}.content[{j}]")}}
            )
        elif kind == "thinking" and role == "assistant":
            thinking += str(block.get("thinking", ""))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(result, f"{where}.content[{j}].content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind != "redacted_thinking":
            raise bad_request(
                f"'{where}.content[{j}]': a {role} turn cannot hold a {kind!r} block", param="messages"
            )
    out: list[dict[str, Any]] = results
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": _joined(parts) if parts else None}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = thinking
        out.append(turn)
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _joined(parts: list[dict[str, Any]]) -> Any:
    """An assistant turn's content: its text when it is only text."""
    if all(p["type"] == "text" for p in parts):
        return "".join(str(p["text"]) for p in parts)
    return parts


def _image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]  # (remote images only with --allow-remote-images)
    raise bad_request(f"'{where}.source' must be a base64 or url image source", param="messages")


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise bad_request(f"'{where}' needs a 'name'", param="tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# -- the handlers --------------------------------------------------------------------------


async def messages(server: OpenAIServer, request: Request) -> Any:
    try:
        return await _messages_answer(server, request)
    except Exception as exc:  # Anthropic's error shape, with the status the server chose
        return anthropic_error(error_response(request, exc))


async def count_tokens(server: OpenAIServer, request: Request) -> Any:
    """``/v1/messages/count_tokens``: ``{"input_tokens": n}``, the prompt a request renders to."""
    try:
        raw = await server.read_body(request, "/v1/messages/count_tokens")
        data = {**raw.data, "max_tokens": raw.data.get("max_tokens", 1)}
        body = Body(await run_step(request, PREPARE, to_chat_body, data), "/v1/messages/count_tokens")
        llm = server.need_llm()
        chat = read_chat_request(body, server.chat_template)
        rendered = await run_step(request, PREPARE, render_chat_request, llm, chat)
        return Response(dumps_json({"input_tokens": len(rendered.tokens)}), media_type="application/json")
    except Exception as exc:
        return anthropic_error(error_response(request, exc))


async def _messages_answer(server: OpenAIServer, request: Request) -> Any:
    chat = await translated_chat(server, request, "/v1/messages", to_chat_body)
    llm, prompt, setup, params = server.need_llm(), chat.prompt, chat.setup, chat.setup.params
    priority, client, model = chat.priority, chat.client, server.model_name
    if chat.stream:
        gen = await primed(generate_all(llm, [prompt], params, priority, client), request.receive)
        return EventStream(_events(gen, setup, model, len(prompt) if isinstance(prompt, list) else 0))
    (result,) = await until_disconnect(
        request.receive, server.collect(llm, [prompt], params, priority, client)
    )
    server.raise_for_errors(result.outputs)
    out = setup.finish_output(result.outputs[0])
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.text:
        blocks.append({"type": "text", "text": out.text})
    for call in out.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    answer = {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        **_stop(out),
        "usage": _usage(out),
    }
    encoded = await run_step(request, ENCODE, dumps_json, answer, small=small_work([out.text]))
    return Response(encoded, media_type="application/json")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _stop(out: CompletionOutput) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of an answer (split: ``tool_calls`` when it
    stopped after calls)."""
    if out.finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if out.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(out.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(out: CompletionOutput) -> dict[str, int]:
    usage = out.usage
    return {
        "input_tokens": usage.prompt_tokens - usage.reused_tokens,
        "cache_read_input_tokens": usage.reused_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps_json({"type": kind, **data}) + b"\n\n"


async def _events(
    gen: AsyncIterator[tuple[int, Any]], setup: ChatSetup, model: str | None, n_prompt: int
) -> AsyncIterator[bytes]:
    """Anthropic's stream of one answer: a content block per kind of piece, in order."""
    message: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model}
    usage = {"input_tokens": n_prompt, "output_tokens": 0}
    yield _event(
        "message_start",
        {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}},
    )
    answer = setup.stream()
    index, open_kind = -1, ""  # the open block: its index and kind ("": none)

    def begin(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        events = [_event("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        return [*events, _event("content_block_start", {"index": index, "content_block": block})]

    async for _, delta in gen:
        out = delta.output
        pieces = answer.feed(delta.text) + (answer.finish(out.finish_reason) if out is not None else [])
        for piece in pieces:
            if isinstance(piece, ToolCallHead):
                for event in begin(
                    "tool", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
                ):
                    yield event
                continue
            if isinstance(piece, ToolCallArguments):
                data = {"type": "input_json_delta", "partial_json": piece.arguments}
            elif isinstance(piece, ReasoningDelta):
                if open_kind != "thinking":
                    for event in begin("thinking", {"type": "thinking", "thinking": ""}):
                        yield event
                data = {"type": "thinking_delta", "thinking": piece.text}
            else:
                assert isinstance(piece, ContentDelta)
                if open_kind != "text":
                    for event in begin("text", {"type": "text", "text": ""}):
                        yield event
                data = {"type": "text_delta", "text": piece.text}
            yield _event("content_block_delta", {"index": index, "delta": data})
        if out is None:
            continue
        if out.finish_reason == "error":
            error = generation_error(out)
            yield _event("error", {"error": {"type": error.type, "message": error.message}})
            return
        if open_kind:
            yield _event("content_block_stop", {"index": index})
        split = setup.finish_output(out)
        yield _event("message_delta", {"delta": _stop(split), "usage": _usage(split)})
        yield _event("message_stop", {})


def anthropic_error(response: Response) -> Response:
    """An OpenAI-shaped error response in Anthropic's shape, its status and headers kept."""
    try:
        error = json.loads(bytes(response.body))["error"]
    except (ValueError, KeyError, TypeError):
        return response
    body = {
        "type": "error",
        "error": {"type": error.get("type") or "api_error", "message": error.get("message", "")},
    }
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")
    }
    return Response(
        dumps_json(body), status_code=response.status_code, headers=headers, media_type="application/json"
    )
