"""Regenerate ``reranker_reference.json``: transformers' logits for the test cross-encoder.

Run by hand (it needs torch and transformers, which the test suite does not)::

    python tests/data/make_reranker_reference.py

It writes the random-weight ``BertForSequenceClassification`` of
``llamabatch.gguf.testing_reranker.make_cross_encoder`` (numpy + safetensors, seeded: the tests
make the same bytes), loads it with ``AutoModelForSequenceClassification`` and ``AutoTokenizer``
on the CPU in float32, and stores, for every pair of ``PAIRS`` and ``LONG_PAIRS`` (tokenized as
``CrossEncoder`` tokenizes: lists of pairs, ``truncation=True`` to the model's 64 positions), the
input ids, the
token types and the logits; the logits of a two-label variant (seed 26); and the input ids and
logits of the XLM-RoBERTa cross-encoder of ``make_xlmr_cross_encoder`` (seed 27).
``tests/embed/test_reranker.py`` compares llamabatch's scores against them (tolerance 1e-3).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "reranker_reference.json"


def _run(model_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, list]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, types, logits = [], [], []
    for query, document in pairs:
        # a batch of pairs, as CrossEncoder.predict tokenizes (an empty document stays a segment)
        enc = tokenizer([query], [document], truncation=True, max_length=64, return_tensors="pt")
        with torch.no_grad():
            out = model(**enc).logits[0]
        ids.append(enc["input_ids"][0].tolist())
        types.append(enc["token_type_ids"][0].tolist() if "token_type_ids" in enc else None)
        logits.append([float(x) for x in out])
    return {"input_ids": ids, "token_type_ids": types, "logits": logits}


def main() -> None:
    """Make the models, run transformers, write the reference."""
    from llamabatch.gguf.testing_reranker import (
        LONG_PAIRS,
        PAIRS,
        make_cross_encoder,
        make_xlmr_cross_encoder,
    )

    pairs = [*PAIRS, *LONG_PAIRS]
    with tempfile.TemporaryDirectory() as tmp:
        one = _run(make_cross_encoder(Path(tmp) / "one"), pairs)
        two = _run(make_cross_encoder(Path(tmp) / "two", seed=26, num_labels=2), pairs)
        xlmr = _run(make_xlmr_cross_encoder(Path(tmp) / "xlmr"), pairs)
    reference = {
        "pairs": pairs,
        **one,
        "logits_two_labels": two["logits"],
        "xlmr_input_ids": xlmr["input_ids"],
        "xlmr_logits": xlmr["logits"],
    }
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {REFERENCE} ({len(pairs)} pairs)")


if __name__ == "__main__":
    main()
