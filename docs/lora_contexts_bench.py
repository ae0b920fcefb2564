"""LoRA adapters, the alternatives to switching measured on the real SmolLM2: what a switch of
adapter set costs in one context, what a second context on the same model costs instead, and
(``--merged``) one adapter merged into the weights. The figures in README's "LoRA adapters".

    python docs/lora_contexts_bench.py [--threads 2] [--slots 4] [--rounds 40] [--merged]

Everything runs on the binding's objects (``_ffi``: ``Model``, ``Context``, ``LoraAdapter``,
``set_adapters``; the core's ``BatchPool``), no engine: each tick decodes one token for each
of ``--slots`` sequences (after a 32-token prompt each), as a decode tick of the engine does.

1. One context, two adapters: rounds of a tick after no change, then a tick right after
   ``llama_set_adapters_lora`` switched to the other adapter; the switch cost is the median
   difference (interleaved, so the growing KV weighs on both alike). The base model's tick
   (no adapter) is measured the same way.
2. A second context on the same model (the weights are shared; llama.cpp gives each context
   its own KV cache and compute buffers): its KV bytes (from the model's shape), the process's
   resident memory before and after it is made and has decoded, and the tick of two contexts,
   each keeping its own adapter, decoded one after the other (no switch ever) against one
   context switching between the two adapters every tick.
3. ``--merged``: the adapter merged into the weights (``gguf/merge_lora.py``, F16), its tick
   against the base model's and the unmerged adapter's.
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llamabatch._core.batch import BatchPool
from llamabatch._ffi.context import Context, check_decode
from llamabatch._ffi.kv_types import kv_bytes_per_cell
from llamabatch._ffi.lora import LoraAdapter, set_adapters
from llamabatch._ffi.model import Model
from llamabatch.gguf.merge_lora import merge_lora
from llamabatch.testing import make_lora, real_model_path

PROMPT = [1, 504, 3575, 282, 4649, 314, 253, 1345] * 4  # 32 ids of SmolLM2's vocabulary


class LlamaLog(logging.Handler):
    """llama.cpp's own figures from its log: each re-plan's time (``reserve took X ms``, after
    every switch) and the compute buffers of each new context (``compute buffer size``)."""

    RESERVE = re.compile(r"reserve took ([0-9.]+) ms")
    BUFFER = re.compile(r"compute buffer size = +([0-9.]+) MiB")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)  # llamabatch forwards llama.cpp's INFO lines at DEBUG
        self.reserve_ms: list[float] = []
        self.buffer_mib: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if m := self.RESERVE.search(text):
            self.reserve_ms.append(float(m.group(1)))
        if m := self.BUFFER.search(text):
            self.buffer_mib.append(float(m.group(1)))


def rss() -> int:
    """Resident bytes of this process (Linux)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


class Slots:
    """``n`` sequences on ``context``, each a prompt, then one token per tick."""

    def __init__(self, context: Context, n: int) -> None:
        self.context, self.n = context, n
        self.prompt = [token % context.model.n_vocab for token in PROMPT]  # any model's vocabulary
        self.pool = BatchPool(max(context.n_batch, len(PROMPT) * n), n)
        self.pos = [0] * n

    def prefill(self) -> None:
        self.context.memory_clear()
        batch = self.pool.acquire()
        for seq in range(self.n):
            batch.add_sequence(self.prompt, seq, 0)
            self.pos[seq] = len(PROMPT)
        check_decode(self.context.decode_address(batch.address))
        self.pool.release(batch)

    def tick(self) -> float:
        """One decode of one token per sequence; its seconds."""
        batch = self.pool.acquire()
        for seq in range(self.n):
            batch.add(self.prompt[self.pos[seq] % len(PROMPT)], self.pos[seq], seq, True)
            self.pos[seq] += 1
        t0 = time.perf_counter()
        check_decode(self.context.decode_address(batch.address))
        elapsed = time.perf_counter() - t0
        self.pool.release(batch)
        return elapsed


def median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def shown(samples: list[float]) -> str:
    """Median and minimum (the least disturbed on a busy machine), milliseconds."""
    return f"{median_ms(samples):7.2f} ms (min {1000.0 * min(samples):6.2f})"


def interleaved(rounds: int, steps: list[Callable[[], float]]) -> list[list[float]]:
    """``rounds`` rounds of ``steps`` in order; each step's times."""
    out: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            out[i].append(step())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="sequences decoded per tick")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--n-ubatch", type=int, default=512, help="llama.cpp's n_ubatch: the graph a re-plan reserves"
    )
    parser.add_argument("--model", default=None, help="base GGUF (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--merged", action="store_true", help="also time the adapter merged into the weights")
    args = parser.parse_args()
    base = Path(args.model) if args.model else real_model_path()
    n_ctx = (len(PROMPT) + 3 * args.rounds + 8) * args.slots
    options = {
        "n_ctx": n_ctx,
        "n_seq_max": args.slots,
        "n_threads": args.threads,
        "kv_unified": True,
        "n_ubatch": args.n_ubatch,
    }
    print(
        f"{base.name}, {args.slots} sequences per tick, {args.rounds} rounds, {args.threads} threads, "
        f"n_ubatch {args.n_ubatch}"
    )
    llama_log = LlamaLog()
    source = logging.getLogger("llamabatch.llama_cpp")
    source.addHandler(llama_log)
    source.setLevel(logging.DEBUG)
    source.propagate = False
    with tempfile.TemporaryDirectory() as d, Model(base) as model:
        paths = [make_lora(base, Path(d) / f"a{i}.gguf", rank=8, seed=i) for i in range(2)]
        adapters = [LoraAdapter(model, p) for p in paths]

        # 1. switching in one context
        rss0 = rss()
        n_buffers = len(llama_log.buffer_mib)
        ctx = Context(model, **options)
        buffer_mib = sum(llama_log.buffer_mib[n_buffers:])
        slots = Slots(ctx, args.slots)
        slots.prefill()
        slots.tick()
        rss1 = rss()
        current = [0]

        def same() -> float:
            return slots.tick()

        def switched() -> float:
            current[0] ^= 1
            t0 = time.perf_counter()
            set_adapters(ctx, [adapters[current[0]]], None)
            call = time.perf_counter() - t0
            return call + slots.tick()

        set_adapters(ctx, [], None)
        slots.prefill()
        (base_tick,) = interleaved(args.rounds, [same])
        set_adapters(ctx, [adapters[0]], None)
        slots.prefill()
        n_reserves = len(llama_log.reserve_ms)
        same_t, switch_t = interleaved(args.rounds, [same, switched])
        reserves = llama_log.reserve_ms[n_reserves:]
        t0 = time.perf_counter()
        for _ in range(50):
            current[0] ^= 1
            set_adapters(ctx, [adapters[current[0]]], None)
        set_call = (time.perf_counter() - t0) / 50
        switch_ms = median_ms(switch_t) - median_ms(same_t)
        print(f"base model tick            {shown(base_tick)}")
        print(f"adapter tick, no switch    {shown(same_t)}")
        print(f"adapter tick after switch  {shown(switch_t)}  (difference of medians {switch_ms:.2f} ms)")
        if reserves:
            print(
                f"  llama.cpp's re-plan after a switch ('reserve took'): median "
                f"{statistics.median(reserves):.2f} ms, min {min(reserves):.2f} ms over {len(reserves)}"
            )
        print(f"  llama_set_adapters_lora itself: {1e6 * set_call:.1f} us")

        # 2. a second context on the same model, its own adapter, never switching
        n_buffers = len(llama_log.buffer_mib)
        ctx2 = Context(model, **options)
        buffer2_mib = sum(llama_log.buffer_mib[n_buffers:])
        slots2 = Slots(ctx2, args.slots)
        set_adapters(ctx2, [adapters[1]], None)
        slots2.prefill()
        slots2.tick()
        rss2 = rss()
        kv = kv_bytes_per_cell(model, "f16", "f16") * ctx2.n_ctx
        print(
            f"one context: {(rss1 - rss0) / 2**20:.1f} MiB resident; "
            f"a second: {(rss2 - rss1) / 2**20:.1f} MiB "
            f"(KV {kv / 2**20:.1f} MiB for {ctx2.n_ctx} cells; compute buffers as llama.cpp reports them: "
            f"{buffer_mib:.1f} MiB, then {buffer2_mib:.1f} MiB)"
        )
        set_adapters(ctx, [adapters[0]], None)
        slots.prefill()
        slots2.prefill()

        def two_contexts() -> float:
            return slots.tick() + slots2.tick()

        def one_context_switching() -> float:
            return switched() + switched()

        two_t, one_t = interleaved(args.rounds // 2, [two_contexts, one_context_switching])
        print(f"two sets, a tick each: two contexts {shown(two_t)}, one context switching {shown(one_t)}")
        ctx2.close()
        ctx.close()

    if args.merged:
        with tempfile.TemporaryDirectory() as d:
            adapter = make_lora(base, Path(d) / "a.gguf", rank=8, seed=0)
            merged = merge_lora(base, adapter, Path(d) / "merged.gguf").path
            ticks: dict[str, str] = {}
            for label, path, lora in (
                ("base", base, None),
                ("unmerged", base, adapter),
                ("merged", merged, None),
            ):
                with Model(path) as model, Context(model, **options) as context:
                    if lora is not None:
                        set_adapters(context, [LoraAdapter(model, lora)], None)
                    slots = Slots(context, args.slots)
                    slots.prefill()
                    slots.tick()
                    (samples,) = interleaved(args.rounds, [slots.tick])
                    ticks[label] = shown(samples)
            size = merged.stat().st_size if merged.exists() else 0
            print(
                "tick: "
                + ", ".join(f"{k} {v}" for k, v in ticks.items())
                + f" (merged file {size / 2**20:.0f} MiB, base {base.stat().st_size / 2**20:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
