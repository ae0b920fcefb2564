"""Why the same prompt's logits change with its batch-mates, through llama.cpp's C API only.

Run: ``python docs/batch_invariance.py [model.gguf]`` (default: SmolLM2-135M-Instruct, as
``llamabatch.testing.real_model_path()`` finds it), 2 threads. Every case decodes a prompt
with llamabatch's binding (``llamabatch._ffi``: ``Model``, ``Context``, one ``llama_batch``
of our own) and compares its last logits row, bit for bit, with the same prompt decoded
alone in a fresh context. No engine, scheduler or slot table is involved: what differs here
differs in llama.cpp (commit 0c1e570).

What it shows (README, "Reproducibility"): positions, masks, the batch's order and its cut
are the same in every case; what changes is which of ggml's CPU flash-attention kernels runs
(``ggml-cpu/ops.cpp``, ``ggml_compute_forward_flash_attn_ext_f16``), chosen by the ubatch's
shape, and, in the tiled kernel, which 64-cell tile a sequence's cells fall in:

- one row at a time, the cells in order and masked ones skipped, for fewer than 64 query rows
  of a stream: neither batch-mates nor where the cells sit change a bit;
- tiled (64 query rows x 64 cells, f16/f32 caches only) for 64 rows or more: a prompt
  decoded with others (101 rows in one unified ubatch) rounds differently from the same
  prompt alone (5 rows), and moving its cells by 7 changes the tiles;
- split over the threads by KV cells (f16/f32 caches only) for one row of one stream over
  512 cells or more: a long sequence's decode step alone rounds differently from the same
  step beside another stream.

A q8_0 (or bf16) cache never takes the last two, so with one stream per sequence (cells in
position order) every row takes the first kernel: ``batch_invariant=True``. Without flash
attention (the CPU defaults) a stream's attention products go through llamafile's sgemm for
two rows or more and ggml's ``vec_dot`` for one: the prompts cut into ubatches beside the
others change by that too.
"""

from __future__ import annotations

import sys

import numpy as np

from llamabatch._ffi import lib
from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.model import Model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The chemical symbol for gold is",
    "Translate to French: Good morning, my friend.",
    "Explain why the sky is blue in one sentence.",
    "1, 1, 2, 3, 5, 8,",
    "The quick brown fox",
    "What is the boiling point of water in Celsius?",
    "Name a famous painting by Leonardo da Vinci.",
]

Entry = tuple[int, int, int, bool]  # token, position, seq_id, logits wanted


def decode(ctx: Context, entries: list[Entry]) -> dict[int, np.ndarray]:
    """One ``llama_decode`` of ``entries`` in this order; the logits rows asked for, by index."""
    batch = lib.llama_batch_init(len(entries), 0, 1)
    try:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        check_decode(lib.llama_decode(ctx.ptr, batch))
    finally:
        lib.llama_batch_free(batch)
    return {i: ctx.logits_ith(i) for i, e in enumerate(entries) if e[3]}


def rows(tokens: list[int], seq: int, pos0: int = 0) -> list[Entry]:
    """A prompt's entries, logits on its last token."""
    return [(t, pos0 + i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)]


def context(
    model: Model, unified: bool = True, kv_type: str = "f16", n_seq: int = 12, flash_attn: bool = True
) -> Context:
    return Context(
        model,
        n_ctx=1024 * (1 if unified else n_seq),
        n_batch=2048,
        n_ubatch=512,
        n_seq_max=n_seq,
        n_threads=2,
        n_threads_batch=2,
        flash_attn=flash_attn,
        kv_unified=unified,
        type_k=kv_type,
        type_v=kv_type,
    )


def max_logprob_diff(a: np.ndarray, b: np.ndarray) -> float:
    def logprobs(x: np.ndarray) -> np.ndarray:
        return x - np.logaddexp.reduce(x)

    return float(np.max(np.abs(logprobs(a) - logprobs(b))))


def together_vs_alone(
    model: Model, unified: bool, kv_type: str, flash_attn: bool = True
) -> tuple[int, float]:
    """The 12 prompts in one batch against each alone: (first logits rows equal, max
    |delta log-prob|)."""
    tokens = [model.tokenize(p) for p in PROMPTS]
    with context(model, unified, kv_type, flash_attn=flash_attn) as ctx:
        entries = [e for s, t in enumerate(tokens) for e in rows(t, s)]
        out = decode(ctx, entries)
        ends = np.cumsum([len(t) for t in tokens]) - 1
        together = [out[int(i)] for i in ends]
    alone = []
    for t in tokens:
        with context(model, unified, kv_type, flash_attn=flash_attn) as ctx:
            alone.append(decode(ctx, rows(t, 0))[len(t) - 1])
    same = sum(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
    return same, max(max_logprob_diff(a, b) for a, b in zip(alone, together, strict=True))


def tiled_kernel(model: Model, kv_type: str = "f16") -> dict[str, bool]:
    """One unified buffer: is the prompt's last row the same as alone when ... (True: same)."""
    prompt = model.tokenize(PROMPTS[0])
    filler = model.tokenize(" ".join(PROMPTS))
    with context(model, kv_type=kv_type) as ctx:
        alone = decode(ctx, rows(prompt, 0))[len(prompt) - 1]
    cases: dict[str, bool] = {}

    def check(name: str, before: list[Entry], batch: list[Entry], index: int, expect: np.ndarray) -> None:
        with context(model, kv_type=kv_type) as ctx:
            if before:
                decode(ctx, before)
            cases[name] = bool(np.array_equal(decode(ctx, batch)[index], expect))

    n = len(prompt)
    check(
        "same cells, 40 rows of another prompt after it (< 64 rows)",
        [],
        rows(prompt, 0) + rows(filler[:40], 1),
        n - 1,
        alone,
    )
    check(
        f"same cells, {len(filler)} rows of another prompt after it (tiled for f16)",
        [],
        rows(prompt, 0) + rows(filler, 1),
        n - 1,
        alone,
    )
    check("its cells moved by 7 (< 64 rows)", rows(filler[:7], 1), rows(prompt, 0), n - 1, alone)
    long_prompt = filler[:80]
    with context(model, kv_type=kv_type) as ctx:
        long_alone = decode(ctx, rows(long_prompt, 0))[79]
    check("80 rows, its cells moved by 64", rows(filler[:64], 1), rows(long_prompt, 0), 79, long_alone)
    check(
        "80 rows (tiled for f16), its cells moved by 7",
        rows(filler[:7], 1),
        rows(long_prompt, 0),
        79,
        long_alone,
    )
    return cases


def split_kv(model: Model, kv_type: str = "f16") -> bool:
    """One stream per sequence: a 260-token sequence's next decode step alone (one row of one
    stream over 512 cells: split among the threads) against the same step beside a second
    stream's row. True: the same logits."""
    text = model.tokenize(" ".join(PROMPTS) * 3)[:260]
    short = model.tokenize(PROMPTS[1])
    out = []
    for beside in (False, True):
        with context(model, unified=False, kv_type=kv_type, n_seq=2) as ctx:
            for start in range(0, len(text), 50):  # chunks under 64 rows: never tiled
                decode(ctx, rows(text[start : start + 50], 0, start))
            decode(ctx, rows(short, 1))
            step = [(text[0], len(text), 0, True)]
            if beside:
                step.append((short[0], len(short), 1, True))
            out.append(decode(ctx, step)[0])
    return bool(np.array_equal(out[0], out[1]))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        path = argv[1]
    else:
        from llamabatch.testing import real_model_path

        path = str(real_model_path())
    with Model(path) as model:
        for unified, kv_type in ((True, "f16"), (True, "q8_0"), (False, "f16"), (False, "q8_0")):
            same, diff = together_vs_alone(model, unified, kv_type)
            layout = "unified" if unified else "per-stream"
            print(f"12 prompts together vs alone, {layout}, FA on, {kv_type} KV: {same}/12 equal, ", end="")
            print(f"max |dlogprob| {diff:.3f}")
        same, diff = together_vs_alone(model, False, "f16", flash_attn=False)
        print(f"12 prompts together vs alone, per-stream, FA off, f16 KV: {same}/12 equal, ", end="")
        print(f"max |dlogprob| {diff:.3f}")
        for kv_type in ("f16", "q8_0"):
            for name, same in tiled_kernel(model, kv_type).items():
                print(f"unified, {kv_type} KV, {name}: {'same' if same else 'DIFFERENT'}")
            print(
                f"per-stream, {kv_type} KV, a long decode step alone vs beside another stream: "
                f"{'same' if split_kv(model, kv_type) else 'DIFFERENT'}"
            )


if __name__ == "__main__":
    main(sys.argv)
