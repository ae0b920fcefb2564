"""``llamabatch serve``: its options (``add_arguments``) and its entry point (``main``).

Importing this module does not import the web stack, so ``llamabatch --help`` works without
the ``[server]`` extra; ``main`` says what to install when it is missing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from llamabatch.config import EngineConfig
from llamabatch.runtime.thread_priority import DEFAULT_WORKER_NICE, MAX_NICE
from llamabatch.toolcalls import TOOL_CALL_PARSERS
from llamabatch.toolcalls.reasoning import REASONING_FORMATS

__all__ = ["add_arguments", "main"]

DESCRIPTION = (
    "Serve a GGUF model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
    "/v1/embeddings, /v1/models), /v1/rerank (--rerank-model), plus /health, /metrics (Prometheus), "
    "/tokenize and /detokenize, llama-server's /completion, /infill, /apply-template and /props, and "
    "OpenAI's /v1/responses and Anthropic's /v1/messages. "
    "Needs: pip install 'llamabatch[server]'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s options to ``parser`` (names follow llama.cpp's ``llama-server``)."""
    parser.add_argument(
        "-m",
        "--model",
        help="the GGUF model that generates text (default, when no model of any kind is given: "
        "SmolLM2-135M-Instruct, fetched once into the cache)",
    )
    parser.add_argument(
        "--embedding-model", metavar="EMB.gguf", help="a GGUF embedding model for /v1/embeddings"
    )
    parser.add_argument(
        "--rerank-model", metavar="RERANKER.gguf", help="a GGUF cross-encoder (reranker) for /v1/rerank"
    )
    parser.add_argument("--rerank-model-name", help="the reranker's id (default: the file's stem)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLAMABATCH_API_KEY"),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: $LLAMABATCH_API_KEY); "
        "not on /health, /metrics",
    )
    parser.add_argument("--served-model-name", help="the model id clients see (default: the file's stem)")
    parser.add_argument("--embedding-model-name", help="the embedding model's id (default: the file's stem)")
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template file, or a llama.cpp built-in name (e.g. chatml), instead of the GGUF's",
    )
    # tool calls and reasoning (llamabatch.toolcalls)
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="the tool-call format of answers (default auto: from the chat template; none: never parse)",
    )
    parser.add_argument(
        "--reasoning-format",
        default="auto",
        choices=REASONING_FORMATS,
        help="auto: <think> blocks go to reasoning_content; none: they stay in the content",
    )
    parser.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        help="load bare --lora FILE adapters without applying them to every request (llama-server's)",
    )
    # the engine's options, generated from EngineConfig (llama-server's names and aliases)
    EngineConfig.add_cli_args(
        parser.add_argument_group("generation engine (LLM)"),
        overrides={"max_queue": {"help": "requests waiting for a slot before 503s"}},
    )
    e = parser.add_argument_group("embedding engine (Embedder)")
    e.add_argument(
        "--embedding-batch-size", type=int, default=512, help="tokens per embedding pack (n_batch)"
    )
    e.add_argument("--embedding-n-seq-max", type=int, default=64, help="texts per embedding pack")
    e.add_argument("--embedding-threads", type=int, default=None, help="default: --threads")
    e.add_argument(
        "--embedding-mmproj",
        metavar="PATH",
        help="image encoder + projector GGUF of the embedding model: /v1/embeddings takes images "
        "(llama-server's {prompt_string, multimodal_data}; the --max-image-* limits apply)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="default info",
    )
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    h = parser.add_argument_group("HTTP limits (see README: Running it safely)")
    h.add_argument(
        "--max-body-mb",
        type=_positive_float,
        default=16.0,
        help="largest request body in MiB; bigger ones get 413 (default 16)",
    )
    h.add_argument(
        "--timeout",
        type=_positive_float,
        default=60.0,
        help="seconds a client may take to send a request's headers, to send its body, or stall "
        "reading the answer (default 60)",
    )
    h.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="seconds an idle kept-alive connection stays open"
    )
    h.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections (and requests in flight) before new requests get 503 (default 1024)",
    )
    h.add_argument(
        "--allowed-hosts",
        type=_names,
        default=[],
        metavar="NAMES",
        help="comma-separated Host names served besides IP addresses and localhost ('*': any; "
        "'.example.com': a domain and its subdomains); other Hosts get 400 (closes DNS rebinding)",
    )
    h.add_argument(
        "--cors-origins",
        type=_names,
        default=[],
        metavar="ORIGINS",
        help="comma-separated origins web pages may call from ('*': any); default none (no CORS)",
    )
    h.add_argument(
        "--forwarded-allow-ips",
        type=_names,
        default=[],
        metavar="IPS",
        help="comma-separated proxy addresses whose X-Forwarded-For/-Proto are trusted; default none",
    )
    h.add_argument(
        "--client-priority",
        type=_client_priority,
        default="off",
        metavar="off|clamp:LO..HI",
        help="what becomes of a request's 'priority': off (default): ignored, all run at 0; "
        "clamp:LO..HI: clamped into [LO, HI] (lower runs first)",
    )
    h.add_argument(
        "--max-queue-per-client",
        type=_positive_int,
        default=None,
        metavar="N",
        help="completions one client (peer address) may have queued or running; more get 429 "
        "(default: half of --max-queue, plus --n-parallel)",
    )

    w = parser.add_argument_group("CPU work of requests (see README: Running it safely)")
    w.add_argument(
        "--work-timeout-s",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="wall-clock seconds one request's CPU-heavy steps (parsing, tokenizing, templates, "
        "grammars, encoding the answer; waiting for a worker included) may take in all; past it "
        "the work is abandoned and the request gets 503 work_timeout (default 30)",
    )
    w.add_argument(
        "--work-threads",
        type=_positive_int,
        default=2,
        metavar="N",
        help="threads of each pool of CPU-heavy steps (prepare, grammar, rerank, encode; default 2)",
    )
    w.add_argument(
        "--worker-nice",
        type=_worker_nice,
        default=DEFAULT_WORKER_NICE,
        metavar="N",
        help="niceness levels the threads of those pools, and the reranker's and embedder's engine "
        "threads, run below the generation engine's (Linux; 0: the same priority; default "
        f"{DEFAULT_WORKER_NICE})",
    )


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def _worker_nice(value: str) -> int:
    number = int(value)
    if not 0 <= number <= MAX_NICE:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_NICE}], got {value}")
    return number


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _client_priority(value: str) -> Any:
    from llamabatch.server.client_policy import ClientPriority

    try:
        return ClientPriority.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    return value  # a built-in name (or an inline template)


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted; returns the exit status."""
    try:
        import uvicorn

        from llamabatch.server.app import create_app
        from llamabatch.server.lora import applied_adapters
        from llamabatch.server.offload import shorten_gil_waits
    except ImportError as exc:
        print(
            f"llamabatch serve: error: {exc.name or exc} is missing; pip install 'llamabatch[server]'",
            file=sys.stderr,
        )
        return 1
    from llamabatch import LLM, Embedder, LlamaBatchError

    if not args.model and not args.embedding_model and not args.rerank_model:
        from llamabatch.gguf.real_model import default_model_path

        args.model = str(default_model_path())  # SmolLM2-135M-Instruct, else the random test model
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    llm = embedder = reranker = None
    try:
        if args.model:
            llm = LLM(
                args.model,
                config=EngineConfig.from_cli_args(args),
                tool_call_parser=args.tool_call_parser,
                reasoning_format=args.reasoning_format,
            )
        if args.embedding_model:
            embedder = Embedder(
                args.embedding_model,
                n_batch=args.embedding_batch_size,
                n_seq_max=args.embedding_n_seq_max,
                n_threads=args.embedding_threads or args.n_threads,
                n_gpu_layers=args.n_gpu_layers,
                mmproj=args.embedding_mmproj,
                allow_remote_images=args.allow_remote_images,
                max_image_bytes=args.max_image_bytes,
                max_image_pixels=args.max_image_pixels,
                max_images_per_request=args.max_images_per_request,
            )
        if args.rerank_model:
            from llamabatch.embed.reranker import Reranker

            reranker = Reranker(
                args.rerank_model,
                n_batch=args.embedding_batch_size,
                n_seq_max=args.embedding_n_seq_max,
                n_threads=args.embedding_threads or args.n_threads,
                n_gpu_layers=args.n_gpu_layers,
            )
        app = create_app(
            llm,
            lora_applied=applied_adapters(args.lora_adapters, args.lora_init_without_apply),
            embedder=embedder,
            reranker=reranker,
            rerank_model_name=args.rerank_model_name,
            model_name=args.served_model_name,
            embedding_model_name=args.embedding_model_name,
            api_key=args.api_key,
            chat_template=_chat_template(args.chat_template),
            limits=_limits(args),
            cors_origins=args.cors_origins,
            client_policy=_client_policy(args),
            work_limits=_work_limits(args),
        )
    except (FileNotFoundError, ValueError, LlamaBatchError) as exc:
        print(f"llamabatch serve: error: {exc}", file=sys.stderr)
        for engine in (llm, embedder, reranker):
            if engine is not None:
                engine.close()
        return 1
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: exit through this handler
    # (not the default one, which would kill the process before the engines close).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    shorten_gil_waits()  # the engine threads take the GIL back from the pools within 0.5 ms
    try:
        _serve(
            uvicorn,
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            timeout_graceful_shutdown=5,
            **_http_options(args),
        )
    finally:
        for engine in (llm, embedder, reranker):
            if engine is not None:
                engine.close()
    return 0


def _limits(args: argparse.Namespace) -> Any:
    """The app's ``ServerLimits`` from the flags; ``--host``, when a name, is allowed too."""
    from llamabatch.server.limits import ServerLimits

    return ServerLimits(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        timeout=args.timeout,
        allowed_hosts=(*args.allowed_hosts, args.host),
    )


def _work_limits(args: argparse.Namespace) -> Any:
    """The app's ``WorkLimits`` from ``--work-timeout-s``, ``--work-threads`` and ``--worker-nice``."""
    from llamabatch.server.offload import WorkLimits

    return WorkLimits(timeout_s=args.work_timeout_s, threads=args.work_threads, nice=args.worker_nice)


#: seconds from SIGTERM (or Ctrl-C) to a forced exit (status 1) when the graceful shutdown
#: (answers in flight get 5 s, then the engines close) is held up, e.g. by a thread that never
#: returns: the interpreter would wait for it forever
SHUTDOWN_DEADLINE_S = 10.0


def _serve(uvicorn: Any, app: Any, **options: Any) -> None:
    """``uvicorn.run(app, **options)``, but a SIGTERM or SIGINT also abandons the requests'
    CPU work at once (``Offload.close``: their clients get 503) and arms the forced exit."""
    import asyncio
    import threading
    import time

    offload = app.state.offload

    def exit_at_deadline() -> None:
        time.sleep(SHUTDOWN_DEADLINE_S)
        logging.getLogger("llamabatch.server").error(
            "shutdown still unfinished after %g s: exiting now", SHUTDOWN_DEADLINE_S
        )
        os._exit(1)

    class Server(uvicorn.Server):  # type: ignore[misc, name-defined]
        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if not first:
                return
            threading.Thread(target=exit_at_deadline, name="llamabatch-shutdown", daemon=True).start()
            try:  # a signal handler may run inside any loop callback: close from a fresh one
                asyncio.get_running_loop().call_soon_threadsafe(offload.close)
            except RuntimeError:
                offload.close()

    server = Server(uvicorn.Config(app, **options))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(3)  # uvicorn's status for a failed start (e.g. the port is taken)


def _client_policy(args: argparse.Namespace) -> Any:
    """The app's ``ClientPolicy`` from ``--client-priority`` and ``--max-queue-per-client``."""
    from llamabatch.server.client_policy import ClientPolicy

    return ClientPolicy(args.client_priority, args.max_queue_per_client)


def _http_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's options for the HTTP edge: the request head's deadline (``--timeout``; a
    protocol class of ours, uvicorn has none), keep-alive, the connection cap, and proxy
    headers trusted only from ``--forwarded-allow-ips`` (uvicorn trusts 127.0.0.1 by default)."""
    from llamabatch.server.limits import deadline_protocol

    return {
        "http": deadline_protocol("auto", args.timeout),
        "ws": "none",  # no endpoint speaks WebSocket: upgrade requests are refused
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": args.max_connections,
        "proxy_headers": bool(args.forwarded_allow_ips),
        "forwarded_allow_ips": args.forwarded_allow_ips or None,
    }
