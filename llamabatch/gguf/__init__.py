"""GGUF tooling: read a GGUF header (``reader``), check a file before llama.cpp loads it
(``check``), convert Hugging Face models (``convert``) and make the random-weight test models
(``testing``). Pure Python over the ``gguf`` package; it never calls llama.cpp.

This package is ``llamabatch.gguf``; the third-party ``gguf`` package (its constants and writer)
is imported by absolute name as ``gguf``.
"""

from llamabatch.gguf.check import GGUFReport, check_gguf, tensor_names

__all__ = ["GGUFReport", "check_gguf", "tensor_names"]
