"""A chat request before it reaches an engine: the conversation rendered with its chat
template and tokenized (``render``), then its sampling parameters and answer reader
(``RenderedChat.setup``); ``prepare`` is both steps.

``LLM.chat`` and ``LLMEngine.add_request`` call ``prepare``. The server calls the two steps
apart: its default ``max_tokens`` depends on the prompt's length, and each step runs in its
own worker pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from llamabatch.chat.setup import ChatRequestError, ChatSetup, prepare_chat
from llamabatch.errors import ImageError
from llamabatch.params import SamplingParams
from llamabatch.prompts.chat_template import chat_prompt_tokens, render_chat
from llamabatch.prompts.images import image_parts
from llamabatch.toolcalls import check_tool_call_parser
from llamabatch.toolcalls.reasoning import check_reasoning_format

__all__ = [
    "ChatFacade",
    "ChatOptions",
    "ChatRequest",
    "ChatRequestOptions",
    "RenderedChat",
    "is_conversation",
    "prepare",
    "render",
]


class ChatOptions:
    """An engine's chat defaults: ``tool_call_parser`` ("auto": from the chat template, a
    format name, or "none") and ``reasoning_format`` ("auto" or "none")."""

    def __init__(self, tool_call_parser: str = "auto", reasoning_format: str = "auto") -> None:
        self.tool_call_parser = check_tool_call_parser(tool_call_parser)
        self.reasoning_format = check_reasoning_format(reasoning_format)


class ChatFacade(Protocol):
    """What ``render`` and ``prepare`` read of an engine facade (``LLM``, ``LLMEngine``)."""

    @property
    def model(self) -> Any: ...

    @property
    def chat_options(self) -> ChatOptions: ...

    @property
    def n_ctx_seq(self) -> int: ...

    def check_prompt_bytes(self, text: str, max_tokens: int = 0) -> None: ...


def is_conversation(prompt: object) -> bool:
    """Whether ``prompt`` is a list of chat messages (mappings), not text or token ids."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and isinstance(prompt[0], Mapping)
    )


class ChatRequestOptions(TypedDict, total=False):
    """``LLMEngine.add_request``'s options for a conversation (as ``LLM.chat`` takes them)."""

    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    chat_template: str | None
    add_generation_prompt: bool
    chat_template_kwargs: Mapping[str, Any] | None


@dataclass(frozen=True)
class ChatRequest:
    """A chat request's fields beside its sampling parameters, as ``LLM.chat`` takes them."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: object = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = None

    @property
    def template_tools(self) -> Sequence[Mapping[str, Any]] | None:
        """The tools the chat template shows the model (none with ``tool_choice: "none"``)."""
        return None if self.tool_choice == "none" else self.tools


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered (``text``) and tokenized (``tokens``); ``template`` is the chat
    template's source (it tells the tool-call format), ``options`` the engine's defaults."""

    request: ChatRequest
    text: str
    tokens: list[int]
    template: str | None
    options: ChatOptions
    #: with ``image_url`` parts: the prompt with its images (``generate/vision.py``'s
    #: ``MediaPrompt``; ``tokens`` are then its positions' ids)
    media: Any = None

    @property
    def prompt(self) -> Any:
        """What the engine takes as this chat's prompt: its token ids, or its ``media``."""
        return self.tokens if self.media is None else self.media

    def setup(self, params: SamplingParams | Mapping[str, Any] | None) -> ChatSetup:
        """The request's ``ChatSetup``: ``params`` with the grammars of its tools, and the reader
        of its answers. Grammar building is CPU work (the server runs it off its event loop).
        Raises ``ChatRequestError`` naming the field at fault."""
        request, options = self.request, self.options
        return prepare_chat(
            SamplingParams.coerce(params),
            template=self.template,
            prompt=self.text,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
            tool_call_parser=options.tool_call_parser,
            reasoning_format=options.reasoning_format,
        )


def render(facade: ChatFacade, request: ChatRequest, *, truncate: bool = False) -> RenderedChat:
    """``request``'s conversation under the chat template of ``facade``'s model, as text and as
    token ids (special tokens parsed, no doubled BOS). The caller keeps the model alive (an
    ``LLM``'s: inside ``worker.using_resources()``).

    Raises ``ChatRequestError`` naming the field at fault (``messages`` or
    ``chat_template_kwargs``), ``PromptTooLong`` for a text that no tokenization could fit in
    the context (checked before tokenizing it, unless ``truncate``: the request's
    ``SamplingParams.truncate`` keeps the prompt's end)."""
    model = facade.model
    vision = getattr(getattr(facade, "core", None), "vision", None)
    try:
        messages, images, parts = image_parts(request.messages, vision.mtmd.marker if vision else "")
    except ImageError as exc:
        raise ChatRequestError(str(exc), exc.part) from exc
    if images and vision is None:
        raise ChatRequestError(
            "image_url parts need a model with an image encoder (mmproj, --mmproj)", parts[0]
        )
    try:
        text = render_chat(
            model,
            messages,
            tools=request.template_tools,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except ValueError as exc:
        raise ChatRequestError(str(exc), getattr(exc, "param", "messages")) from exc
    if not truncate:
        facade.check_prompt_bytes(text)
    template = request.chat_template if request.chat_template is not None else model.chat_template
    if images and vision is not None:  # the rendered text holds the images' markers: libmtmd splits it
        try:
            media = vision.tokenize(text, images, facade.n_ctx_seq, 0, parts)
        except ImageError as exc:
            raise ChatRequestError(str(exc), exc.part) from exc
        except ValueError as exc:
            raise ChatRequestError(str(exc), "messages") from exc
        return RenderedChat(request, text, media.tokens, template, facade.chat_options, media)
    return RenderedChat(request, text, chat_prompt_tokens(model, text), template, facade.chat_options)


def prepare(
    facade: ChatFacade,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams | Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Any, ChatSetup]:
    """The prompt (``RenderedChat.prompt``: token ids, or the prompt with its images) of the
    conversation ``messages`` for ``facade``'s model and the
    request's ``ChatSetup`` (``render`` then ``RenderedChat.setup``). The caller keeps the model
    alive. Raises ``ChatRequestError`` naming the request field at fault, ``PromptTooLong``,
    or ``SamplingParams``' own errors."""
    request = ChatRequest(
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        chat_template,
        add_generation_prompt,
        chat_template_kwargs,
    )
    params = SamplingParams.coerce(params)
    rendered = render(facade, request, truncate=params.truncate)
    return rendered.prompt, rendered.setup(params)
