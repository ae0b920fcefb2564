"""The ``llamabatch`` command line.

One small function per subcommand (``_cmd_<name>``), each registered by ``build_parser()``
with ``set_defaults(func=...)``; ``main`` parses and dispatches. Subcommands:

- ``convert MODEL_DIR OUT.gguf [--dtype f16|f32]``: convert a BERT-family Hugging Face /
  sentence-transformers model to a GGUF llama.cpp loads (see :mod:`llamabatch.convert`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


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
        choices=("f16", "f32"),
        default="f16",
        help="type of the 2-D weights (1-D tensors are always f32); default f16",
    )
    p.add_argument("--name", default=None, help="general.name of the GGUF (default: from the directory)")
    p.set_defaults(func=_cmd_convert)


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
    _add_convert(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``llamabatch`` command line with ``argv`` (default ``sys.argv[1:]``); returns the
    exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
