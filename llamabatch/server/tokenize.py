"""``/tokenize``, ``/detokenize`` and ``/apply-template`` (llama.cpp's server's).

The handlers take the ``OpenAIServer`` of ``app.py`` (the engines, names, key, metrics) and
the request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch.server import prepare
from llamabatch.server.chat import read_chat_request
from llamabatch.server.offload import PREPARE, run_step, small_work
from llamabatch.server.protocol import (
    bad_request,
)
from llamabatch.server.streaming import (
    dumps_json,
    json_response,
)

if TYPE_CHECKING:
    from llamabatch.server.state import OpenAIServer


async def tokenize(server: OpenAIServer, request: Request) -> Response:
    body = await server.read_body(request, "/tokenize")
    text = body.get("prompt", "str")
    if text is None:
        text = body.get("content", "str")  # llama.cpp server's name
    add_special = body.get("add_special_tokens", "bool")
    if add_special is None:
        add_special = body.get("add_special", "bool", True)
    with_pieces = body.get("with_pieces", "bool", False)
    messages = body.get("messages", "list")
    if (text is None) == (messages is None):
        raise bad_request("give either 'prompt' (or 'content') or 'messages'", param="prompt")
    if server.llm is not None:
        model, max_len = server.llm.model, server.llm.n_ctx_seq
    elif server.embedder is not None:
        model, max_len = server.embedder.model, server.embedder.max_tokens
    else:
        assert server.reranker is not None
        model, max_len = server.reranker.model, server.reranker.max_length
    add_generation_prompt = body.get("add_generation_prompt", "bool", True)
    llm = server.need_llm() if messages is not None else server.llm
    body.warn_unknown()

    def run() -> list[Any]:  # in a worker thread: rendering and tokenizing are CPU work
        if messages is not None:
            assert llm is not None
            try:
                rendered = llm.apply_chat_template(
                    messages,
                    chat_template=server.chat_template,
                    add_generation_prompt=add_generation_prompt,
                )
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
            tokens = prepare.chat_tokens(llm, rendered)
        elif llm is not None:
            prepare.prompt_fits(llm, text, "prompt")
            tokens = llm.tokenize(text, add_special=add_special, parse_special=True)
        else:
            tokens = model.tokenize(text, add_special=add_special, parse_special=True)
        if not with_pieces:
            return tokens
        return [
            {"id": t, "piece": model.token_to_piece(t, special=True).decode("utf-8", "replace")}
            for t in tokens
        ]

    def answer() -> bytes:  # a context's worth of tokens and pieces is a big answer
        out = run()
        return dumps_json({"tokens": out, "count": len(out), "max_model_len": max_len})

    small = text is not None and small_work([text])
    return Response(await run_step(request, PREPARE, answer, small=small), media_type="application/json")


async def detokenize(server: OpenAIServer, request: Request) -> Response:
    body = await server.read_body(request, "/detokenize")
    tokens = body.get("tokens", "list")
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be an array of token ids", param="tokens")
    body.warn_unknown()
    engine = server.llm or server.embedder or server.reranker
    model = engine.model  # type: ignore[union-attr]
    try:  # special tokens as text, in a worker thread
        text = await run_step(request, PREPARE, model.detokenize, tokens, unparse_special=True)
    except ValueError as exc:
        raise bad_request(str(exc), param="tokens") from None
    return json_response({"prompt": text, "content": text})


async def apply_template(server: OpenAIServer, request: Request) -> Response:
    """llama-server's ``/apply-template``: a chat request's prompt as ``/v1/chat/completions``
    would render it (its messages, tools and ``chat_template_kwargs``), ``{"prompt": text}``;
    sampling fields are ignored, as there."""
    body = await server.read_body(request, "/apply-template")
    llm = server.need_llm()
    chat = read_chat_request(body, server.chat_template)
    rendered = await run_step(request, PREPARE, prepare.render_chat_request, llm, chat)
    return json_response({"prompt": rendered.text})
