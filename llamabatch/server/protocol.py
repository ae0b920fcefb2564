"""OpenAI request bodies to ``SamplingParams`` and prompts; outputs to OpenAI response JSON.

No web framework here: plain dicts in and out, so the mapping can be read (and tested) on
its own. Every rejected value raises :class:`APIError` naming the request field.
"""

from __future__ import annotations

import base64
import logging
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

from llamabatch import CompletionOutput, GrammarDeadEnd, SamplingParams
from llamabatch.param_spec import request_fields

logger = logging.getLogger("llamabatch.server")

#: OpenAI fields accepted and deliberately without effect here (no warning for them).
IGNORED_FIELDS = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream"}
)

#: the ``SamplingParams`` fields ``sampling_params`` reads with a rule of its own (declared
#: ``Request(custom=True)`` in ``params.py``); it reads the others as declared
CUSTOM_FIELDS = frozenset({"max_tokens", "top_k", "seed", "stop", "logit_bias", "logprobs", "n"})
#: SamplingParams field -> the request fields it comes from, where it has several (for error
#: messages: ``repetition_penalty`` or ``repeat_penalty``)
_PARAM_FIELDS = {
    name: request.names
    for name, request in request_fields(SamplingParams)
    if not request.custom and len(request.names) > 1
}

#: vLLM clamps log-probabilities that JSON cannot carry (-inf) to this.
LOGPROB_FLOOR = -9999.0

#: the most messages one chat request may hold (rendering them is CPU work per message)
MAX_MESSAGES = 4096

#: request fields a grammar can come from: a grammar error names the one the request used
_GRAMMAR_FIELDS = ("grammar", "response_format", "json_schema")


class APIError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def generation_error(out: CompletionOutput) -> APIError:
    """The answer to a completion that ended with ``finish_reason="error"``: a 400 when the
    request's own constraints led there (``GrammarDeadEnd``: its grammar with ``min_tokens``,
    ``stop_token_ids`` or ``logit_bias`` admits no token), else a 500."""
    if out.error_type is not None and issubclass(out.error_type, GrammarDeadEnd):
        message = f"the request's constraints stopped its generation: {out.error}"
        return bad_request(message, code="grammar_dead_end")
    return APIError(500, f"generation failed: {out.error}", type="server_error")


def context_length_exceeded(limit: int, prompt: int, completion: int, param: str = "messages") -> APIError:
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the {'messages' if param == 'messages' else 'prompt'}, "
        f"{completion} in the completion). Please reduce the length of the "
        f"{'messages' if param == 'messages' else 'prompt'} or completion.",
        param=param,
        code="context_length_exceeded",
    )


def param_of_error(message: str, default: str | None = None) -> str | None:
    """The request field a ``SamplingParams`` ``ValueError`` message is about."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    if not match:
        return default
    return match.group(1)


# -- reading a body ---------------------------------------------------------------------------

_KINDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "int": (int, "an integer"),
    "number": ((int, float), "a number"),
    "bool": (bool, "a boolean"),
    "str": (str, "a string"),
    "list": (list, "an array"),
    "dict": (dict, "an object"),
}


class Body:
    """A JSON request body read field by field; fields never read are reported as ignored."""

    def __init__(self, data: Any, endpoint: str) -> None:
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        self.data = data
        self.endpoint = endpoint
        self.read: set[str] = set(IGNORED_FIELDS)

    def __contains__(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(
        self,
        name: str,
        kind: str,
        default: Any = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """The field's value (``default`` when absent or null), type- and range-checked."""
        self.read.add(name)
        value: Any = self.data.get(name)
        if value is None:
            return default
        types, what = _KINDS[kind]
        if (isinstance(value, bool) and kind != "bool") or not isinstance(value, types):
            raise bad_request(f"'{name}' must be {what}, got {_json_type(value)}", param=name)
        value = cast(Any, value)  # a JSON number, bool, str, list or dict: checked above
        if kind == "number" and not math.isfinite(value):
            raise bad_request(f"'{name}' must be a finite number", param=name)
        if minimum is not None and value < minimum:
            raise bad_request(f"'{name}' must be >= {minimum}, got {value}", param=name)
        if maximum is not None and value > maximum:
            raise bad_request(f"'{name}' must be <= {maximum}, got {value}", param=name)
        return value

    def warn_unknown(self) -> None:
        """Log the fields this server does not know (they are ignored, as vLLM does)."""
        unknown = sorted(set(self.data) - self.read)
        if unknown:  # at most 10 names, each cut to 40 characters: a hostile body is not a log
            names = [name[:40] for name in unknown[:10]]
            if len(unknown) > 10:
                names.append(f"... {len(unknown)} in all")
            logger.warning("%s: ignoring unknown request fields %s", self.endpoint, names)


def _json_type(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


# -- sampling ---------------------------------------------------------------------------------


def sampling_params(
    body: Body,
    *,
    chat: bool,
    prompt_tokens: int,
    n_ctx_seq: int,
    logprobs: int | None,
    lora: tuple[tuple[str, float], ...] = (),
) -> SamplingParams:
    """The ``SamplingParams`` of a completions or chat request whose longest prompt has
    ``prompt_tokens`` tokens (``lora``: its adapter set, ``server/lora.py``); ``APIError``
    names the offending field."""
    max_field = "max_tokens"
    max_tokens = None
    if chat:
        max_tokens = body.get("max_completion_tokens", "int", minimum=1)
        if max_tokens is not None:
            max_field = "max_completion_tokens"
            body.get("max_tokens", "int", minimum=1)
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "int", minimum=1)
    room = n_ctx_seq - prompt_tokens
    if max_tokens is None:
        # chat: up to the context's end (as OpenAI and vLLM); legacy completions: 16
        max_tokens = room if chat else min(16, room)
    if room < 1 or max_tokens > room:
        raise context_length_exceeded(
            n_ctx_seq, prompt_tokens, max(max_tokens, 1), param="messages" if chat else "prompt"
        )

    kw: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs}
    if lora:
        kw["lora"] = lora
    for param, request in request_fields(SamplingParams):  # the fields declared plain
        if request.custom:
            continue
        for name in request.names:  # the last one given wins
            value = body.get(name, request.kind)
            if value is not None:
                kw[param] = value
    kw["n"] = body.get("n", "int", 1, minimum=1, maximum=128)
    top_k = body.get("top_k", "int")
    if top_k is not None:
        kw["top_k"] = max(0, top_k)  # vLLM's -1 and llama.cpp's <= 0: off
    seed = body.get("seed", "int")
    if seed is not None and seed != -1:  # -1: random (llama.cpp's convention)
        kw["seed"] = seed
    kw["stop"] = _stop(body)
    logit_bias = body.get("logit_bias", "dict")
    if logit_bias:
        kw["logit_bias"] = _logit_bias(logit_bias)
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        field = param_of_error(str(exc))
        if field == "max_tokens":
            field = max_field
        elif field == "logprobs":
            field = "top_logprobs" if chat else "logprobs"
        else:
            field = request_field(body, field)
        raise bad_request(str(exc), param=field) from None


def request_field(body: Body, param: str | None) -> str | None:
    """The request field a ``SamplingParams`` field ``param`` came from: ``repeat_last_n``
    for ``penalty_last_n``, and ``response_format`` or ``json_schema`` for ``grammar`` (both
    become a grammar) when the request sent those."""
    if param in _PARAM_FIELDS:
        return next((n for n in _PARAM_FIELDS[param] if n in body), param)
    if param in _GRAMMAR_FIELDS and param not in body:
        return next((n for n in _GRAMMAR_FIELDS if n in body), param)
    return param


def _stop(body: Body) -> tuple[str, ...]:
    stop = body.data.get("stop")
    body.read.add("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or an array of strings", param="stop")
    return tuple(s for s in stop if s)  # OpenAI ignores empty stop strings


def _logit_bias(bias: Mapping[str, Any]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(
                f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(
                f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", param="logit_bias"
            )
        out[token] = float(value)
    return out


# -- prompts ----------------------------------------------------------------------------------


def completion_prompts(body: Body) -> list[str | list[int]]:
    """``prompt``: a string, an array of strings, an array of token ids, or an array of those."""
    prompt = body.data.get("prompt")
    body.read.add("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a non-empty string or array", param="prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad_request(f"'prompt[{i}]' is empty", param="prompt")
        elif not (isinstance(p, list) and p and all(_is_token(t) for t in p)):
            raise bad_request(
                f"'prompt[{i}]' must be a non-empty string or an array of token ids", param="prompt"
            )
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(body: Body) -> list[dict[str, Any]]:
    messages = body.data.get("messages")
    body.read.add("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"'messages' holds {len(messages)} messages; the limit is {MAX_MESSAGES}", param="messages"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object", param="messages")
    return messages


# -- responses --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: str | None) -> str | None:
    """Our finish reasons in OpenAI's words (``cancelled`` is vLLM's ``abort``)."""
    return {"cancelled": "abort"}.get(reason, reason) if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenText:
    """Token id -> its text and UTF-8 bytes, cached (a model's vocabulary does not change)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token)
        if entry is None:
            piece = self._model.token_to_piece(token, special=True)
            entry = self._cache[token] = (piece.decode("utf-8", "replace"), list(piece))
        return entry


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(
    token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], top_n: int
) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries, one per token."""
    content = []
    for token, dist in zip(token_ids, logprobs, strict=False):
        text, raw = token_text(token)
        best = sorted(dist.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": text,
                "logprob": _lp(dist.get(token, -math.inf)),
                "bytes": raw,
                "top_logprobs": [
                    {"token": token_text(t)[0], "logprob": _lp(v), "bytes": token_text(t)[1]} for t, v in best
                ],
            }
        )
    return content


def completion_logprobs(
    token_text: TokenText,
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float] | None],
    offset: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (``text_offset`` starting at ``offset``); a
    ``None`` entry (an echoed prompt's first token) has null log-probabilities."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, dist in zip(token_ids, logprobs, strict=False):
        text = token_text(token)[0]
        tokens.append(text)
        if dist is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(_lp(dist.get(token, -math.inf)))
            top.append({token_text(t)[0]: _lp(v) for t, v in sorted(dist.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(
    token_text: TokenText,
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float] | None],
    top_n: int,
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (``None`` for the first), token id (a
    string) to ``{"logprob", "rank", "decoded_token"}``. Each dict holds the ``top_n`` most
    likely tokens, best first (ranks 1..top_n), then the prompt's token if not among them
    (its rank unknown: null)."""
    out: list[dict[str, Any] | None] = []
    for dist in logprobs[: len(token_ids)]:
        out.append(
            None
            if dist is None
            else {
                str(t): {
                    "logprob": _lp(v),
                    "rank": r + 1 if r < top_n else None,
                    "decoded_token": token_text(t)[0],
                }
                for r, (t, v) in enumerate(dist.items())
            }
        )
    return out


def encode_embedding(vector: Any, encoding_format: str) -> Any:
    """A float32 vector as a JSON list, or base64 of its little-endian bytes (OpenAI's)."""
    if encoding_format == "base64":
        import numpy as np

        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()
