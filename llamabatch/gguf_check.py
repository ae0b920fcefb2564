"""The public path of the GGUF validator named in the README: ``llamabatch.gguf_check.check_gguf``.

The code lives in ``llamabatch/gguf/`` (``reader.py`` parses the header, ``check.py`` and its
siblings check it)."""

from llamabatch.gguf.check import GGUFReport, check_gguf, tensor_names

__all__ = ["GGUFReport", "check_gguf", "tensor_names"]
