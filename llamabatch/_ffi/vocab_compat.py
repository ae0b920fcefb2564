"""Whether two models share a vocabulary, as speculative decoding needs (draft and target).

llama.cpp's own check (``common_speculative_are_compatible`` in its ``common/speculative.cpp``)
compares the tokenizer type, whether BOS / EOS are added, the BOS and EOS ids, the vocabulary
sizes (it tolerates a difference of up to 128) and the text of every token from id 5 on.
llamabatch compares the same facts but stricter: the sizes must be equal (a draft's
distribution ``q`` and the target's ``p`` are compared token id by token id), the EOT id too, and
the texts of all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamabatch._ffi import ffi, lib
from llamabatch._ffi.model import Model

__all__ = ["VocabFacts", "vocab_facts", "vocab_mismatch"]


@dataclass(frozen=True)
class VocabFacts:
    """What two vocabularies must agree on."""

    vocab_type: int
    n_vocab: int
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int
    eot: int
    texts: tuple[bytes, ...]


def vocab_facts(model: Model) -> VocabFacts:
    """Read ``model``'s :class:`VocabFacts` from llama.cpp."""
    vocab = model.vocab
    n = lib.llama_vocab_n_tokens(vocab)
    texts = tuple(ffi.string(lib.llama_vocab_get_text(vocab, t)) for t in range(n))
    return VocabFacts(
        vocab_type=int(lib.llama_vocab_type(vocab)),
        n_vocab=n,
        add_bos=bool(lib.llama_vocab_get_add_bos(vocab)),
        add_eos=bool(lib.llama_vocab_get_add_eos(vocab)),
        bos=lib.llama_vocab_bos(vocab),
        eos=lib.llama_vocab_eos(vocab),
        eot=lib.llama_vocab_eot(vocab),
        texts=texts,
    )


def vocab_mismatch(draft: VocabFacts, target: VocabFacts) -> str | None:
    """None when ``draft`` can draft for ``target``, else what differs (one sentence)."""
    for field in ("vocab_type", "n_vocab", "add_bos", "add_eos", "bos", "eos", "eot"):
        a, b = getattr(draft, field), getattr(target, field)
        if a != b:
            return f"{field} differs (draft {a!r}, target {b!r})"
    for token, (a_text, b_text) in enumerate(zip(draft.texts, target.texts, strict=True)):
        if a_text != b_text:
            return f"the text of token {token} differs (draft {a_text!r}, target {b_text!r})"
    return None
