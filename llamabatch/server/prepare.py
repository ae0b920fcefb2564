"""A request's CPU work before it reaches an engine, and the checks that bound it.

The endpoints run these as steps of their request, in the worker pools of ``offload.py``
(``params_pool`` picks the pool of a request's sampling parameters): tokenizing, and the byte
bound that refuses a text before tokenizing it when no tokenization of it could fit the context
(tokenizing a long run without whitespace costs time quadratic in its length).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from llamabatch import LLM, Embedder, PromptTooLong
from llamabatch.chat import ChatRequest, ChatRequestError, ChatSetup, RenderedChat, render
from llamabatch.generate.llm_engine import prompt_bytes_bound
from llamabatch.params import SamplingParams
from llamabatch.prompts.chat_template import chat_prompt_tokens
from llamabatch.prompts.inputs import check_token_ids
from llamabatch.server.lora import request_lora
from llamabatch.server.offload import GRAMMAR, PREPARE, run_step
from llamabatch.server.protocol import Body, bad_request, encode_embedding, sampling_params
from llamabatch.server.streaming import dumps_json

__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "chat_setup",
    "chat_tokens",
    "check_embedding_sizes",
    "check_queue_room",
    "embedding_response",
    "params_pool",
    "prompt_fits",
    "render_chat_request",
    "tokenize_prompts",
]

#: the most texts one /v1/embeddings request may hold (OpenAI's limit)
MAX_EMBEDDING_INPUTS = 2048


#: request fields that make grammars (schema conversion, grammar parsing: heavy CPU work)
GRAMMAR_FIELDS = ("grammar", "json_schema", "response_format", "tools")


def params_pool(body: Body) -> str:
    """The pool that builds a request's sampling parameters and tool setup: ``GRAMMAR`` when
    the body holds a grammar, schema or tools (so that hostile ones queue behind each other,
    never in front of plain requests), else ``PREPARE``."""
    return GRAMMAR if any(name in body for name in GRAMMAR_FIELDS) else PREPARE


async def request_params(
    server: Any,
    request: Any,
    body: Body,
    *,
    chat: bool,
    prompt_tokens: int,
    logprobs: int | None,
    small: bool = False,
) -> SamplingParams:
    """A request's ``SamplingParams`` (``sampling_params``: its fields, its adapters), built in
    the pool ``params_pool`` chooses (``small``: quick enough for the event loop)."""
    llm = server.need_llm()
    return await run_step(
        request,
        params_pool(body),
        sampling_params,
        body,
        lora=request_lora(body, list(llm.lora_adapters()), server.lora_applied),
        chat=chat,
        prompt_tokens=prompt_tokens,
        n_ctx_seq=llm.n_ctx_seq,
        logprobs=logprobs,
        small=small,
    )


def check_queue_room(llm: LLM, n_prompts: int, n: int) -> None:
    """400 for a request whose completions could never wait in the queue together (a 503
    would tell the client to retry what can never succeed)."""
    if n > llm.max_queue:
        raise bad_request(
            f"'n' is {n}, more completions than the server queues at once (--max-queue {llm.max_queue})",
            param="n",
        )
    if n_prompts * n > llm.max_queue:
        raise bad_request(
            f"{n_prompts} prompts x n={n} make {n_prompts * n} completions, more than the server "
            f"queues at once (--max-queue {llm.max_queue}); send fewer prompts per request",
            param="prompt",
        )


def prompt_fits(llm: LLM, text: str, param: str) -> None:
    """400 ``context_length_exceeded`` for text too long for any tokenization to fit."""
    try:
        llm.check_prompt_bytes(text)
    except PromptTooLong as exc:
        raise bad_request(str(exc), param=param, code="context_length_exceeded") from None


def tokenize_prompts(llm: LLM, prompts: Sequence[Any]) -> list[list[int]]:
    """Each completions prompt (text or token ids) as token ids, by the engine's own rules
    (``LLM.tokenize_prompt``, ``inputs.check_token_ids``)."""
    token_prompts = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt_fits(llm, prompt, "prompt")
            prompt = llm.tokenize_prompt(prompt)
        else:
            try:
                check_token_ids(prompt, llm.model.n_vocab)
            except ValueError as exc:
                raise bad_request(f"'prompt[{i}]': {exc}", "prompt") from None
        token_prompts.append(prompt)
    return token_prompts


def chat_tokens(llm: LLM, text: str) -> list[int]:
    """A rendered chat prompt's token ids, as the chat pipeline makes them
    (``chat_prompt_tokens``: special tokens parsed, no doubled BOS)."""
    prompt_fits(llm, text, "messages")
    with llm.worker.using_resources():
        return chat_prompt_tokens(llm.model, text)


def render_chat_request(llm: LLM, chat: ChatRequest) -> RenderedChat:
    """``chat`` rendered and tokenized by the chat pipeline (``llamabatch.chat.render``); a bad
    field is a 400 naming it, a prompt that cannot fit a 400 ``context_length_exceeded``."""
    try:
        with llm.worker.using_resources():
            return render(llm, chat)
    except ChatRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except PromptTooLong as exc:
        raise bad_request(str(exc), param="messages", code="context_length_exceeded") from None


def chat_setup(rendered: RenderedChat, params: SamplingParams) -> ChatSetup:
    """The request's ``ChatSetup`` (tool grammars: call it off the event loop); a bad tool,
    ``tool_choice`` or ``parallel_tool_calls`` is a 400 naming it."""
    try:
        return rendered.setup(params)
    except ChatRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


_EMBEDDING_BOUNDS: weakref.WeakKeyDictionary[Embedder, int | None] = weakref.WeakKeyDictionary()


def _embedding_bound(embedder: Embedder) -> int | None:
    if embedder not in _EMBEDDING_BOUNDS:
        _EMBEDDING_BOUNDS[embedder] = prompt_bytes_bound(embedder.model, embedder.max_tokens)
    return _EMBEDDING_BOUNDS[embedder]


def check_embedding_sizes(embedder: Embedder, texts: Sequence[Any]) -> None:
    """Refuse a text too long for any tokenization to fit the embedder's limit (unless the
    embedder truncates), before it is tokenized (once: ``Embedder.aembed_counted``); the text
    of a prompt with images (llama-server's ``prompt_string``) against one sequence's KV cells,
    before its images are decoded."""
    bound = None if getattr(embedder, "truncate", False) else _embedding_bound(embedder)
    for i, text in enumerate(texts):
        limit, n_tokens = bound, embedder.max_tokens
        if isinstance(text, dict):
            text = text.get("prompt_string", "")
            n_tokens = embedder.context.n_ctx_seq
            limit = None if bound is None else bound // embedder.max_tokens * n_tokens
        if limit is not None and isinstance(text, str) and len(text) * 4 > limit:
            size = len(text.encode("utf-8", "replace"))
            if size > limit:
                raise bad_request(
                    f"'input[{i}]' is {size} bytes, more than {n_tokens} tokens of this "
                    f"vocabulary can hold ({limit} bytes)",
                    param="input",
                    code="context_length_exceeded",
                )


def embedding_response(vectors: Any, encoding: str, model: str | None, n_tokens: int) -> bytes:
    """The ``/v1/embeddings`` answer as JSON bytes, encoded one vector at a time: one
    ``json.dumps`` of every float holds the GIL for the whole of it (every thread waits), one
    per vector lets the event loop in between."""
    items = [
        dumps_json({"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding)})
        for i, v in enumerate(vectors)
    ]
    tail = dumps_json({"model": model, "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
    return b'{"object":"list","data":[' + b",".join(items) + b"]," + tail[1:]
