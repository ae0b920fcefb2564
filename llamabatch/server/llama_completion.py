"""llama-server's own ``POST /completion`` (and ``/completions``; ``/v1/completions`` is
OpenAI's): its request fields and its answer, whole or streamed.

The fields that differ from OpenAI's are translated onto the completions pipeline:
``n_predict`` (or ``max_tokens``; -1, the default: up to the context's end; 0: the prompt is
only evaluated), ``n_probs`` (the N most likely tokens of each generated one),
``logit_bias`` as ``[[token id or text, bias or false], ...]`` (text: each of its tokens;
``false``: banned, as -100), ``return_tokens``, ``response_fields`` and mixed prompts
(``[12, "text", 34]``: token ids and text, one prompt). ``repeat_last_n``, the ``dry_*``,
``xtc_*`` and ``mirostat*`` fields are ``SamplingParams``' own request names already.
``cache_prompt``, ``id_slot`` and ``n_keep`` are accepted and have nothing to do here (the
engine reuses cached prefixes and places requests itself, and never shifts the context).

The answer: ``content``, ``tokens``, ``stop``, ``stop_type`` (``eos``, ``word``, ``limit``),
``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
``timings`` (``prompt_n``, ``prompt_ms``, ... ``predicted_per_second``, ``cache_n``),
``generation_settings``, ``completion_probabilities``; a list of them for several prompts.
Streamed: one ``data:`` event per piece (``content``, ``tokens``, ``"stop": false``) and a
last one with ``"stop": true`` and the figures, without OpenAI's ``[DONE]``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from llamabatch import SamplingParams
from llamabatch.outputs import CompletionOutput
from llamabatch.prompts.infill import InfillUnsupported, infill_tokens
from llamabatch.server import client_policy, prepare
from llamabatch.server.offload import ENCODE, PREPARE, run_step, small_work
from llamabatch.server.protocol import (
    APIError,
    Body,
    TokenText,
    bad_request,
    completion_prompts,
    generation_error,
)
from llamabatch.server.streaming import (
    EventStream,
    dumps_json,
    generate_all,
    primed,
    sse_event,
    until_disconnect,
)

if TYPE_CHECKING:
    from llamabatch import LLM
    from llamabatch.server.state import OpenAIServer

#: llama-server's fields that have nothing to do in this engine (read, so not warned about)
_MOOT_FIELDS = ("cache_prompt", "id_slot", "n_keep")
#: the ``SamplingParams`` reported as ``generation_settings``, by llama-server's names
_SETTINGS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "penalty_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "ignore_eos": "ignore_eos",
    "stop": "stop",
    "seed": "seed",
}


async def completion(server: OpenAIServer, request: Request) -> Any:
    body = await server.read_body(request, "/completion")
    llm = server.need_llm()
    small = small_work([await request.body()])  # (mixed prompts are tokenized here)
    prompts = await run_step(request, PREPARE, _prompts, body, llm, small=small)
    prepare.check_queue_room(llm, len(prompts), 1)
    token_prompts = await run_step(
        request, PREPARE, prepare.tokenize_prompts, llm, prompts, small=small_work(prompts)
    )
    return await _complete(server, request, body, token_prompts)


async def infill(server: OpenAIServer, request: Request) -> Any:
    """llama-server's ``POST /infill``: ``input_prefix`` and ``input_suffix`` (the code around
    the cursor; required), ``input_extra`` (other files: ``[{"filename", "text"}]``) and
    ``prompt`` (text the middle starts with), laid out by ``prompts/infill.py``; the rest as
    ``/completion``. A model without fill-in-the-middle tokens gets a 501."""
    body = await server.read_body(request, "/infill")
    llm = server.need_llm()
    texts = {name: body.get(name, "str") for name in ("input_prefix", "input_suffix")}
    for name, text in texts.items():
        if text is None:
            raise bad_request(f"'{name}' is required", param=name)
        prepare.prompt_fits(llm, text, name)
    extra = _extra(body.get("input_extra", "list", []), llm)
    prompt = body.get("prompt", "str", "")
    n_predict = _n_predict(body)
    model = llm.model

    def tokens() -> list[int]:
        try:
            return infill_tokens(
                model.fim,
                lambda text: model.tokenize(text, add_special=False, parse_special=False),
                texts["input_prefix"],
                texts["input_suffix"],
                extra=extra,
                prompt=prompt,
                bos=model.bos if model.add_bos else -1,
                n_batch=llm.config.n_batch,
                n_predict=max(n_predict, 0),
                n_ctx=llm.n_ctx_seq,
            )
        except InfillUnsupported as exc:
            raise APIError(
                501, f"infill is not supported by this model: {exc}", type="not_supported_error"
            ) from None

    return await _complete(server, request, body, [await run_step(request, PREPARE, tokens)])


def _extra(chunks: list[Any], llm: LLM) -> list[tuple[str, str]]:
    """``input_extra``: ``{"filename": str, "text": str}`` chunks."""
    out = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad_request(
                f'\'input_extra[{i}]\' must be {{"filename": string, "text": string}}', param="input_extra"
            )
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise bad_request(f"'input_extra[{i}].filename' must be a string", param="input_extra")
        prepare.prompt_fits(llm, filename + chunk["text"], "input_extra")
        out.append((filename, chunk["text"]))
    return out


async def _complete(
    server: OpenAIServer, request: Request, body: Body, token_prompts: list[list[int]]
) -> Any:
    """Generate for ``token_prompts`` and answer in llama-server's shapes."""
    llm = server.need_llm()
    n_probs = body.get("n_probs", "int", 0, minimum=0, maximum=100)
    n_predict = _n_predict(body)
    longest = max(map(len, token_prompts))
    room = llm.n_ctx_seq - longest
    body.data["max_tokens"] = max(1, room if n_predict < 0 else min(n_predict, room))  # (the one read)
    body.data.pop("n", None)  # one completion a prompt (llama-server has no "n")
    if isinstance(body.data.get("logit_bias"), list):  # (their texts are tokenized)
        body.data["logit_bias"] = await run_step(request, PREPARE, _bias_pairs, body.data["logit_bias"], llm)
    params = await prepare.request_params(
        server, request, body, chat=False, prompt_tokens=longest, logprobs=n_probs or None
    )
    assert server.token_text is not None  # (set with the engine)
    answer = _Answer(
        server.token_text,
        lambda ids: llm.model.detokenize(ids, unparse_special=True),
        params,
        n_predict,
        body.get("return_tokens", "bool", False),
        _response_fields(body),
        server.model_name,
    )
    stream = body.get("stream", "bool", False)
    priority = client_policy.request_priority(request, body, len(token_prompts) * params.n)
    client = client_policy.client_key(request)
    body.read.update(_MOOT_FIELDS)
    body.warn_unknown()
    if stream:
        gen = await primed(generate_all(llm, token_prompts, params, priority, client), request.receive)
        return EventStream(_events(answer, gen, token_prompts, request))
    results = await until_disconnect(
        request.receive, server.collect(llm, token_prompts, params, priority, client)
    )
    outs = [result.outputs[0] for result in results]
    server.raise_for_errors(outs)

    def encode() -> bytes:
        finals = [answer.final(p, out, False) for p, out in enumerate(outs)]
        return dumps_json(finals[0] if len(finals) == 1 else finals)

    small = not n_probs and small_work(out.text for out in outs)
    return Response(await run_step(request, ENCODE, encode, small=small), media_type="application/json")


async def _events(
    answer: _Answer, gen: AsyncIterator[tuple[int, Any]], prompts: Sequence[list[int]], request: Request
) -> AsyncIterator[bytes]:
    produced: dict[int, int] = {}
    async for p, delta in gen:
        out = delta.output
        if out is not None and out.finish_reason == "error":
            yield sse_event(generation_error(out).body())
            continue
        if answer.n_predict != 0 and (delta.text or delta.token_ids):
            produced[p] = produced.get(p, 0) + len(delta.token_ids)
            yield sse_event(answer.piece(p, delta, produced[p], len(prompts[p])))
        if out is not None:
            yield sse_event(await run_step(request, ENCODE, answer.final, p, out, True, watch=False))


class _Answer:
    """The JSON of one request's results, in llama-server's shapes."""

    def __init__(
        self,
        token_text: TokenText,
        detokenize: Callable[[list[int]], str],
        params: SamplingParams,
        n_predict: int,
        return_tokens: bool,
        fields: list[str] | None,
        model: str | None,
    ) -> None:
        self.token_text = token_text
        self.detokenize = detokenize
        self.params = params
        self.n_predict = n_predict
        self.return_tokens = return_tokens
        self.fields = fields
        self.model = model

    def piece(self, index: int, delta: Any, n_predicted: int, n_prompt: int) -> dict[str, Any]:
        """A streamed piece (``"stop": false``)."""
        chunk: dict[str, Any] = {
            "index": index,
            "content": delta.text,
            "tokens": list(delta.token_ids),  # (always, as llama-server's pieces)
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": n_predicted,
            "tokens_evaluated": n_prompt,
        }
        if delta.logprobs and self.params.logprobs:
            chunk["completion_probabilities"] = self.probabilities(delta.token_ids, delta.logprobs)
        return chunk

    def final(self, index: int, out: CompletionOutput, streamed: bool) -> dict[str, Any]:
        """A prompt's whole answer; streamed, its last event (the text went in the pieces)."""
        evaluate_only = self.n_predict == 0
        tokens = [] if evaluate_only else out.token_ids
        text = "" if evaluate_only else out.text
        usage, timings = out.usage, out.timings
        stop_type, word = _stop_type(out, evaluate_only)
        res: dict[str, Any] = {
            "index": index,
            "content": "" if streamed else text,
            "tokens": list(tokens) if self.return_tokens and not streamed else [],
            "id_slot": -1,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(tokens),
            "tokens_evaluated": usage.prompt_tokens,
            "generation_settings": self.settings(),
            "prompt": self.detokenize(out.prompt_token_ids),
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": usage.prompt_tokens + max(len(tokens) - 1, 0),  # (the last is not decoded)
            "timings": _timings(
                usage.prompt_tokens - usage.reused_tokens, usage.reused_tokens, len(tokens), timings
            ),
        }
        if not streamed and self.params.logprobs and out.logprobs is not None and tokens:
            res["completion_probabilities"] = self.probabilities(tokens, out.logprobs)
        return res if self.fields is None else _select(res, self.fields)

    def settings(self) -> dict[str, Any]:
        params = self.params
        out = {name: getattr(params, field) for name, field in _SETTINGS.items()}
        out["stop"] = list(params.stop)
        out["seed"] = -1 if params.seed is None else params.seed
        out["n_predict"] = self.n_predict
        out["n_probs"] = params.logprobs or 0
        return out

    def probabilities(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]]
    ) -> list[dict[str, Any]]:
        """``completion_probabilities``: per token, its log-probability and the ``n_probs``
        most likely tokens'."""
        n = self.params.logprobs or 0
        entries = []
        for token, dist in zip(token_ids, logprobs, strict=False):
            top = [self._entry(t, v) for t, v in list(dist.items())[:n]]
            entries.append({**self._entry(token, dist.get(token, -math.inf)), "top_logprobs": top})
        return entries

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token_text(token)
        return {
            "id": token,
            "token": text,
            "bytes": raw,
            "logprob": logprob if math.isfinite(logprob) else -1e38,
        }


def _prompts(body: Body, llm: LLM) -> list[str | list[int]]:
    """``prompt``: as ``/v1/completions`` takes it, or one prompt mixing token ids and text
    (``[12, "text", 34]``: the text's tokens without BOS, in place)."""
    prompt = body.data.get("prompt")
    if (
        isinstance(prompt, list)
        and any(isinstance(p, str) for p in prompt)
        and any(_is_id(p) for p in prompt)
    ):
        body.read.add("prompt")
        if not all(isinstance(p, str) or _is_id(p) for p in prompt):
            raise bad_request("a mixed 'prompt' holds token ids and strings only", param="prompt")
        tokens: list[int] = []
        for part in prompt:
            if isinstance(part, str):
                prepare.prompt_fits(llm, part, "prompt")
            tokens += (
                llm.tokenize(part, add_special=False, parse_special=True) if isinstance(part, str) else [part]
            )
        return [tokens]
    return completion_prompts(body)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _n_predict(body: Body) -> int:
    """``n_predict`` (llama-server's), else ``max_tokens``, else -1 (up to the context's end)."""
    n_predict = body.get("n_predict", "int", minimum=-1)
    if n_predict is None:
        n_predict = body.get("max_tokens", "int", -1, minimum=-1)
    return n_predict


def _bias_pairs(pairs: list[Any], llm: LLM) -> dict[str, Any]:
    """llama-server's ``logit_bias`` pairs as OpenAI's map; a text's tokens each get its bias."""
    out: dict[str, Any] = {}
    for pair in pairs[: 1 << 18]:
        if not (isinstance(pair, list) and len(pair) == 2 and (isinstance(pair[0], str) or _is_id(pair[0]))):
            raise bad_request("'logit_bias' pairs are [token id or text, bias or false]", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = -100  # banned (llama-server: -infinity; -100 leaves it no chance either)
        ids = llm.tokenize(key, add_special=False, parse_special=False) if isinstance(key, str) else [key]
        out.update({str(token): bias for token in ids})
    return out


def _response_fields(body: Body) -> list[str] | None:
    fields = body.get("response_fields", "list")
    if fields is not None and not all(isinstance(f, str) and len(f) <= 256 for f in fields[:64]):
        raise bad_request("'response_fields' must be field paths (strings)", param="response_fields")
    return None if fields is None else fields[:64]


def _select(res: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: each path (``a/b`` for nested fields) that exists,
    under its path."""
    out = {}
    for path in fields:
        value: Any = res
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


def _stop_type(out: CompletionOutput, evaluate_only: bool) -> tuple[str, str]:
    if evaluate_only or out.finish_reason == "length":
        return "limit", ""
    if out.finish_reason == "stop":
        if isinstance(out.stop_reason, str):
            return "word", out.stop_reason
        return "eos", ""
    return "none", ""


def _timings(n_prompt: int, n_cached: int, n_predicted: int, t: Any) -> dict[str, Any]:
    """llama-server's ``timings`` from a completion's (prompt: admission to first token;
    generation: the gaps after the first token, ``predicted_n - 1`` of them)."""
    first = t.time_to_first_token if t.time_to_first_token is not None else t.total
    prompt_ms = max(first - t.queue_wait, 0.0) * 1000
    predicted_ms = max(t.total - first, 0.0) * 1000
    res = {
        "cache_n": n_cached,
        "prompt_n": n_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
        "prompt_per_second": 1000 * n_prompt / prompt_ms if prompt_ms else 0.0,
        "predicted_n": n_predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / (n_predicted - 1) if n_predicted > 1 else 0.0,
        "predicted_per_second": 1000 * (n_predicted - 1) / predicted_ms if predicted_ms else 0.0,
    }
    if t.spec_draft_tokens:
        res["draft_n"] = t.spec_draft_tokens
        res["draft_n_accepted"] = t.spec_accepted_tokens
    return res
