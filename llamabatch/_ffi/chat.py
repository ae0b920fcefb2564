"""Chat templates through ``llama_chat_apply_template`` (llama.cpp's built-in templates)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llamabatch._ffi import ffi, lib


def builtin_templates() -> list[str]:
    """Names of the chat templates llama.cpp knows."""
    n = lib.llama_chat_builtin_templates(ffi.NULL, 0)
    names = ffi.new("const char *[]", n)
    lib.llama_chat_builtin_templates(names, n)
    return [ffi.string(names[i]).decode() for i in range(n)]


def apply_template(template: str, messages: Sequence[Mapping[str, str]], add_assistant: bool = True) -> str:
    """Format ``messages`` (dicts with ``role`` and ``content``) with ``template`` (a
    template string from a GGUF, or a built-in name such as ``"chatml"``)."""
    if not messages:
        raise ValueError("messages must not be empty")
    keep = []  # the C strings must outlive the call
    chat = ffi.new("llama_chat_message[]", len(messages))
    for i, message in enumerate(messages):
        try:
            role, content = message["role"], message["content"]
        except (KeyError, TypeError):
            raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'") from None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"messages[{i}]: 'role' and 'content' must be strings")
        role_c, content_c = ffi.new("char[]", role.encode()), ffi.new("char[]", content.encode())
        keep += [role_c, content_c]
        chat[i].role = role_c
        chat[i].content = content_c
    tmpl = template.encode()
    size = 2 * sum(len(m["content"]) + len(m["role"]) for m in messages) + 256
    while True:
        buf = ffi.new("char[]", size)
        n = lib.llama_chat_apply_template(tmpl, chat, len(messages), add_assistant, buf, size)
        if n < 0:
            raise ValueError(
                "llama.cpp does not support this chat template (llama_chat_apply_template failed)"
            )
        if n <= size:
            return ffi.unpack(buf, n).decode("utf-8", "replace")
        size = n
