"""Chat templates: the GGUF's Jinja ``tokenizer.chat_template``, rendered as HF transformers does.

A GGUF made from a Hugging Face model carries the model's chat template, a Jinja2 program
written for ``transformers``' ``apply_chat_template``. :func:`render_chat` renders it the same
way: in a sandbox (``ImmutableSandboxedEnvironment``: a template from a downloaded file can
read its inputs but cannot call arbitrary Python or change them), with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, and the names transformers provides:

* variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``bos_token``,
  ``eos_token`` (plus any ``chat_template_kwargs``, e.g. ``enable_thinking``);
* globals ``raise_exception(message)`` and ``strftime_now(format)``;
* the filter ``tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)``
  (``json.dumps``, without Jinja's HTML escaping);
* the ``{% generation %}...{% endgeneration %}`` block (rendered as its body).

Assistant turns with ``tool_calls`` reach the template with their ``function.arguments`` in
the shape it renders (found once per template by rendering a probe): an object for the
templates that ``tojson`` them (as transformers expects), OpenAI's JSON string for those that
concatenate it (DeepSeek R1). A template that cannot take ``content: None`` (Qwen 3) gets ``""``.

Only a template that cannot be rendered at all (a syntax error, or Python-only constructs the
sandbox refuses) falls back to llama.cpp's built-in templates, which recognise common formats by
their markers. That is decided once per template, when it is first used, by rendering a plain
user/assistant/user probe (:func:`jinja_render_error`), never per request: a request that a
renderable template fails on is an error (``ChatTemplateError``, a ``ValueError``, naming
``chat_template_kwargs`` when the request had some, else ``messages``), so that no request can
skip the template's own checks by making it fail. For the same reason ``chat_template_kwargs``
may not name the environment's globals (``raise_exception``, ``namespace``, ``range``, ...):
one that does is refused. A template that rejects the messages on purpose
(``raise_exception``) raises ``ChatTemplateError``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

logger = logging.getLogger("llamabatch")

__all__ = [
    "ChatTemplateError",
    "chat_prompt_tokens",
    "jinja_render_error",
    "normalize_messages",
    "render_chat",
    "render_jinja",
    "special_token_text",
    "tool_call_arguments",
]


class ChatTemplateError(ValueError):
    """The chat template rejected the request (``raise_exception`` in the template, a render
    error, or ``chat_template_kwargs`` that would replace its globals); ``param`` names the
    request field at fault (``"messages"`` or ``"chat_template_kwargs"``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class _TemplateRaised(Exception):
    """Raised by the template's ``raise_exception``; kept apart from render failures."""


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check ``messages`` and return plain-dict copies with text content.

    Each message is a mapping with a string ``role``. ``content`` may be a string, None (an
    assistant turn that only calls tools) or a list of OpenAI content parts; text parts
    (``{"type": "text", "text": ...}``) are joined with newlines, any other part type raises
    ``ValueError``. Other keys (``name``, ``tool_calls``, ``tool_call_id``, ...) are kept.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of mappings, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        copy = dict(message)
        copy["content"] = _text_content(message.get("content"), i)
        out.append(copy)
    return out


def _text_content(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise ValueError(
                    f"messages[{i}].content[{j}]: only text content parts are supported, got type {kind!r}"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{i}].content[{j}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(
        f"messages[{i}].content must be a string, null or a list of text parts, got {type(content).__name__}"
    )


# -- the Jinja environment --------------------------------------------------------------------


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: plain json.dumps (Jinja's own escapes <, >, & and ' for HTML).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's
        tokens with it (for training masks); for a prompt it renders its body."""

        tags = {"generation"}  # noqa: RUF012 - jinja's Extension API

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    return _environment().from_string(template)


def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render a Jinja chat ``template`` as transformers' ``apply_chat_template(tokenize=False)``.

    Raises ``ChatTemplateError`` when the template calls ``raise_exception`` or a key of
    ``chat_template_kwargs`` would replace one of the environment's globals, and
    ``jinja2.TemplateError`` (or another exception) when it cannot be rendered.
    """
    variables = _client_variables(chat_template_kwargs)
    compiled = _compile(template)
    normalized = normalize_messages(messages)
    if any(m.get("tool_calls") for m in normalized):
        normalized = tool_call_arguments(normalized, as_object=_wants_object_arguments(template))
    variables.update(
        messages=normalized,
        tools=list(tools) if tools is not None else None,
        documents=list(documents) if documents is not None else None,
        add_generation_prompt=bool(add_generation_prompt),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        try:
            return compiled.render(**variables)
        except TypeError:
            # An assistant turn with only tool calls has content None (OpenAI's shape); some
            # templates (Qwen 3) test it as a string: give them "" as llama.cpp does.
            if not any(m.get("content") is None for m in normalized):
                raise
            variables["messages"] = [{**m, "content": m.get("content") or ""} for m in normalized]
            return compiled.render(**variables)
    except _TemplateRaised as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None


def _client_variables(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables; ``ChatTemplateError`` for one that is
    not a name or that would replace a global the template relies on (``raise_exception``
    replaced by a number would turn the template's checks into render errors)."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise ChatTemplateError(
            f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}",
            param="chat_template_kwargs",
        )
    reserved = _environment().globals
    for key in chat_template_kwargs:
        if not isinstance(key, str):
            raise ChatTemplateError(
                f"chat_template_kwargs keys must be strings, got {key!r}", param="chat_template_kwargs"
            )
        if key in reserved:
            raise ChatTemplateError(
                f"chat_template_kwargs.{key}: {key!r} is defined by the chat template's environment "
                "and cannot be replaced",
                param="chat_template_kwargs",
            )
    return dict(chat_template_kwargs)


_RENDER_PROBE = (
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "u"},
)


@lru_cache(maxsize=32)
def jinja_render_error(template: str, bos_token: str = "", eos_token: str = "") -> BaseException | None:
    """Whether our Jinja can render ``template`` at all: None when it renders a plain
    user/assistant/user conversation (or rejects it on purpose with ``raise_exception``),
    else the error (a syntax error, a construct the sandbox refuses). Decided once per
    template; only a template failing here falls back to llama.cpp's built-in templates."""
    try:
        render_jinja(template, _RENDER_PROBE, bos_token=bos_token, eos_token=eos_token)
    except ChatTemplateError:
        return None
    except Exception as exc:
        logger.warning(
            "llamabatch: the Jinja chat template cannot be rendered (%s: %s); "
            "falling back to llama.cpp's built-in templates for it",
            type(exc).__name__,
            exc,
        )
        return exc.with_traceback(None)  # kept in the cache: no frames held
    return None


# -- tool calls in the conversation -------------------------------------------------------------

_PROBE_ARGUMENTS = {"probe_key": "probe_value"}
_PROBE = (
    {"role": "user", "content": "u"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": _PROBE_ARGUMENTS}}
        ],
    },
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "r"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "u"},
)


@lru_cache(maxsize=32)
def _wants_object_arguments(template: str) -> bool:
    """Whether ``template`` renders tool-call arguments given as an object (most do, with
    ``tojson``, as transformers expects) rather than as OpenAI's JSON string (DeepSeek R1
    concatenates them). Found by rendering a probe conversation, as llama.cpp does."""
    try:
        probe = [dict(m) for m in _PROBE]
        text = _compile(template).render(
            messages=probe, tools=None, add_generation_prompt=False, bos_token="", eos_token=""
        )
    except Exception:  # the template cannot take an object there
        return False
    return any(json.dumps(_PROBE_ARGUMENTS, separators=sep) in text for sep in ((", ", ": "), (",", ":")))


def tool_call_arguments(messages: list[dict[str, Any]], *, as_object: bool) -> list[dict[str, Any]]:
    """``messages`` with every assistant tool call's ``function.arguments`` as an object
    (``as_object``) or as a JSON string, whichever the template renders; OpenAI clients send
    strings. Arguments that are not a JSON object are left as they are."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls")
        converted = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must have a function with a name")
            arguments = function.get("arguments")
            if as_object and isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    arguments = parsed
            elif not as_object and isinstance(arguments, Mapping):
                arguments = json.dumps(arguments, ensure_ascii=False)
            converted.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    return out


# -- models ------------------------------------------------------------------------------------


def special_token_text(model: Any, token: int) -> str:
    """The text of a special token id of ``model`` (``""`` when the model has none: id < 0)."""
    if token is None or token < 0 or token >= model.n_vocab:
        return ""
    return model.token_text(token)


@lru_cache(maxsize=1)
def _builtin_names() -> frozenset[str]:
    from llamabatch._ffi.chat import builtin_templates

    return frozenset(builtin_templates())


def render_chat(
    model: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages`` under ``model``'s chat template.

    Args:
        model: a ``llamabatch.Model`` (its ``chat_template``, BOS and EOS tokens are used).
        messages: OpenAI-style messages (see :func:`normalize_messages`).
        tools: tool (function) definitions in OpenAI's JSON shape, passed to the template.
        chat_template: a Jinja template to use instead of the GGUF's, or the name of one of
            llama.cpp's built-in templates (e.g. ``"chatml"``, ``"llama3"``).
        add_generation_prompt: end with the header of the assistant's turn.
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

    Raises:
        ValueError: no template; malformed messages; the template rejected or could not
            render the request, or ``chat_template_kwargs`` would replace a global of the
            template (``ChatTemplateError``, its ``param`` naming the field); or neither
            Jinja nor llama.cpp can render the template.
    """
    template = chat_template if chat_template is not None else model.chat_template
    if template is None:
        name = getattr(getattr(model, "path", None), "name", "the model")
        raise ValueError(f"{name} has no chat template; pass chat_template=... (e.g. 'chatml')")
    if not isinstance(template, str) or not template.strip():
        raise ValueError("chat_template must be a non-empty string")
    normalized = normalize_messages(messages)
    if template in _builtin_names():
        return _render_builtin(template, normalized, tools, add_generation_prompt)
    bos_token = special_token_text(model, model.bos)
    eos_token = special_token_text(model, model.eos)
    broken = jinja_render_error(template, bos_token, eos_token)
    if broken is not None:  # llama.cpp may still know the format by its markers
        try:
            return _render_builtin(template, normalized, tools, add_generation_prompt)
        except ValueError as fallback:
            raise ValueError(
                f"the chat template could not be rendered: Jinja failed ({type(broken).__name__}: "
                f"{broken}) and {fallback}"
            ) from None
    try:
        return render_jinja(
            template,
            normalized,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template_kwargs=chat_template_kwargs,
        )
    except ChatTemplateError:
        raise
    except Exception as exc:  # the template renders, but not this request
        param = "chat_template_kwargs" if chat_template_kwargs else "messages"
        raise ChatTemplateError(
            f"{param}: the chat template could not render this request ({type(exc).__name__}: {exc})",
            param=param,
        ) from None


def _render_builtin(
    template: str,
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    from llamabatch._ffi.chat import apply_template

    if tools:
        raise ValueError("llama.cpp's built-in chat templates cannot render tools")
    plain = []
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise ValueError(f"messages[{i}]: llama.cpp's built-in chat templates cannot render tool calls")
        plain.append({"role": message["role"], "content": message["content"] or ""})
    return apply_template(template, plain, add_assistant=add_generation_prompt)


def chat_prompt_tokens(model: Any, prompt: str) -> list[int]:
    """Tokenize a rendered chat prompt: special-token text becomes special tokens, and BOS is
    added as the model asks unless the template already wrote it (no doubled BOS)."""
    bos = special_token_text(model, model.bos)
    add_special = not (bos and prompt.startswith(bos))
    return model.tokenize(prompt, add_special=add_special, parse_special=True)
