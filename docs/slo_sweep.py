"""SLO attainment against the arrival rate: ``llamabatch serve`` and llama.cpp's ``llama-server``
on the same model and settings, each alone on the machine in turn. The figures and the plot of
README's "Service-level objectives" section.

    python docs/slo_sweep.py [--quick] [-m MODEL] [--out DIR]
    python docs/slo_sweep.py --from-json DIR/slo-sweep.json --out DIR   # redraw only

The held-out heavy mix: short chats and 1,200-token documents (``--mix 64:128,1200:64``,
bench-serve's syntax), Poisson arrivals at every ``--rates`` point, streamed over HTTP by
``bench-serve``'s client (token-id prompts, greedy, ``ignore_eos``). The SLO: first token
within ``--slo-ttft-ms`` (4 s), no gap between a request's tokens over ``--slo-itl-ms``
(250 ms). Servers, each started, measured at its rates and stopped before the next starts:

- ``llamabatch (SLO)``: ``llamabatch serve`` with ``--slo-ttft-ms`` / ``--slo-itl-ms``
  (the engine schedules for them), at every rate;
- ``llama-server``: from ``--llama-server-dir`` (default ``~/.cache/llamabatch-anchors``,
  its libraries on ``LD_LIBRARY_PATH``), at every rate;
- ``llamabatch (no SLO)``: ``llamabatch serve`` without the SLO flags, at ``--light-rate``
  only (the light-load check).

All with ``-np 8 -c 16384 -t 2`` unless told otherwise. Every server gets the same requests
at a rate (the prompts' seed is the rate's point seed, as ``bench-serve --rate`` gives it).
Before each server starts, the llama.cpp libraries' pages are dropped from the page cache
(``llamabatch drop-page-cache``, see README "Benchmarks"), so both read them afresh.

Writes to ``--out``: ``slo-sweep.json`` (every row, rewritten after every point),
``slo-sweep.md`` (a table per rate: attainment, goodput, total tok/s, TTFT p50/p90, ITL
p99; the heavy-load and light-load ratios over llama-server's) and ``slo-sweep.png``
(attainment and total tok/s against the rate, needs matplotlib: ``llamabatch[plot]``).

The servers run in their own process groups and are stopped on every exit: normal end,
error, Ctrl-C, SIGTERM/SIGHUP, and (Linux) this process dying (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llamabatch.bench import latency, options
from llamabatch.bench import serve as bench_serve
from llamabatch.bench.generate import run_workload
from llamabatch.bench.plots import plot_attainment
from llamabatch.bench.report import Column, format_table
from llamabatch.bench.runners import HTTP, HTTPRunner
from llamabatch.bench.workloads import parse_mix, point_seed, resolve_model

OURS_SLO = "llamabatch (SLO)"
OURS_NO_SLO = "llamabatch (no SLO)"
LLAMA_SERVER = "llama-server"

#: the heavy mix of the issue: short chats (64 + 128 tokens), 1,200-token documents (+ 64)
HEAVY_MIX = "64:128,1200:64"
FULL_RATES = (0.1, 0.2, 0.5, 1.0)
QUICK_RATES = (0.2, 0.5)
QUICK_REQUESTS = 6
#: each server's log file in ``--out`` (without ``.log``)
LOG_NAMES = {OURS_SLO: "llamabatch-slo", LLAMA_SERVER: "llama-server", OURS_NO_SLO: "llamabatch-no-slo"}

#: the markdown table's columns (``goodput_rps``: requests meeting the SLO per second)
TABLE_COLUMNS = (
    Column("rate", "rate/s", "g"),
    Column("server", "server"),
    Column("n_requests", "requests", "d"),
    Column("attainment_pct", "SLO met %", ".0f"),
    Column("goodput_rps", "goodput req/s", ".3f"),
    Column("total_tokens_per_s", "total tok/s", ".1f"),
    Column("ttft_p50_ms", "TTFT p50 ms", ".0f"),
    Column("ttft_p90_ms", "TTFT p90 ms", ".0f"),
    Column("itl_p99_ms", "ITL p99 ms", ".1f"),
    Column("itl_max_ms", "ITL max ms", ".0f"),
)
RATIO_COLUMNS = (
    Column("check", "check"),
    Column("server", "server"),
    Column("metric", "metric"),
    Column("ratio", "ratio over llama-server", ".2f", "x"),
    Column("target", "target"),
    Column("met", "met"),
)


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM to the server's own process group, SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)  # the group the server leads (start_new_session)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def wait_ready(process: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    """Poll ``url``/health until it answers 200; raise if the process exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready in {timeout:g} s:\n{_log_tail(log)}")


@contextlib.contextmanager
def running_server(
    argv: Sequence[str],
    url: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    ready_timeout: float = 300.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv`` (a server listening at ``url``), wait until it is ready, yield it, and stop
    it however the block ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        try:
            wait_ready(process, url, ready_timeout, log)
            yield process
        finally:
            _stop(process)


@contextlib.contextmanager
def signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``SystemExit`` (as Ctrl-C raises KeyboardInterrupt), so the
    servers' ``finally`` runs."""

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def measure(
    url: str,
    model: Path,
    rate: float,
    n_requests: int,
    *,
    mix: str = HEAVY_MIX,
    seed: int = 0,
    slo_ttft_ms: float = 4000.0,
    slo_itl_ms: float = 250.0,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """One point of the sweep: bench-serve's mixed workload at ``rate`` against ``url``
    (prompts of ``seed``), its row with the SLO's ``goodput`` and the columns of the table."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--url", url, "-m", str(model), "--workload", "mixed", "--mix", mix),
            *("--rate", repr(rate), "--requests", str(n_requests), "--seed", str(seed)),
            *("--slo-ttft-ms", repr(slo_ttft_ms), "--slo-itl-ms", repr(slo_itl_ms), "--no-progress"),
        ]
    )
    config = options.config_from_args(args)
    client = HTTPRunner(url, timeout=timeout)
    try:
        (run,) = run_workload(
            config, options.workload_from_args(args), [], show_progress=False, others={HTTP: client}
        )
    finally:
        client.close()
    latency.apply_slo([run], config)
    row = run.row()
    share = row.get("goodput")
    row["attainment_pct"] = None if share is None or math.isnan(share) else 100.0 * share
    row["goodput_rps"] = None if row["attainment_pct"] is None else share * row["requests_per_s"]
    return row


def _by(rows: Sequence[dict[str, Any]], server: str, rate: float) -> dict[str, Any] | None:
    return next((r for r in rows if r["server"] == server and r["rate"] == rate), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def target_checks(
    rows: Sequence[dict[str, Any]], heavy_rate: float, light_rate: float
) -> list[dict[str, Any]]:
    """The issue's targets, as ratios over llama-server's row at the same rate: heavy load
    (SLO attainment >= 1.5x at >= 0.9x total tok/s, ours with the SLO flags), light load (ITL
    p99 and TTFT p50 <= 1.1x, ours with and without the SLO flags)."""
    checks: list[dict[str, Any]] = []

    def check(
        name: str, server: str, rate: float, key: str, metric: str, at_least: bool, bound: float
    ) -> None:
        ours, theirs = _by(rows, server, rate), _by(rows, LLAMA_SERVER, rate)
        if ours is None or theirs is None:
            return
        ratio = _ratio(ours.get(key), theirs.get(key))
        met = "-" if ratio is None else "yes" if (ratio >= bound if at_least else ratio <= bound) else "no"
        target = f"{'>=' if at_least else '<='} {bound:g}x"
        checks.append(
            {
                "check": f"{name} ({rate:g}/s)",
                "server": server,
                "metric": metric,
                "ratio": ratio,
                "target": target,
                "met": met,
            }
        )

    check("heavy", OURS_SLO, heavy_rate, "attainment_pct", "SLO met", True, 1.5)
    check("heavy", OURS_SLO, heavy_rate, "total_tokens_per_s", "total tok/s", True, 0.9)
    for server in (OURS_SLO, OURS_NO_SLO):
        check("light", server, light_rate, "itl_p99_ms", "ITL p99", False, 1.1)
        check("light", server, light_rate, "ttft_p50_ms", "TTFT p50", False, 1.1)
    return checks


def markdown(results: dict[str, Any]) -> str:
    """The report: the settings, one table of every row (by rate), the target checks."""
    settings = results["settings"]
    rows = sorted(results["rows"], key=lambda r: (r["rate"], r["server"]))
    lines = [
        "# SLO attainment against the arrival rate",
        "",
        f"Mix {settings['mix']} (prompt:output tokens), {settings['requests']} requests a rate, "
        f"SLO: TTFT <= {settings['slo_ttft_ms']:g} ms and no gap over {settings['slo_itl_ms']:g} ms. "
        f"Servers: {settings['server_args']}; model {settings['model']}.",
        "",
        format_table(rows, TABLE_COLUMNS),
        "",
        "## Targets",
        "",
        format_table(results["checks"], RATIO_COLUMNS)
        if results["checks"]
        else "(no pair of rows to compare)",
        "",
    ]
    return "\n".join(lines)


def write_results(results: dict[str, Any], out: Path, *, plot: bool = True) -> list[Path]:
    """``slo-sweep.json``, ``slo-sweep.md`` and (``plot`` and rows to draw) ``slo-sweep.png``."""
    out.mkdir(parents=True, exist_ok=True)
    results["checks"] = target_checks(
        results["rows"], results["settings"]["heavy_rate"], results["settings"]["light_rate"]
    )
    paths = [out / "slo-sweep.json", out / "slo-sweep.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(results))
    swept = [r for r in results["rows"] if r["server"] != OURS_NO_SLO]
    if plot and swept:
        settings = results["settings"]
        title = (
            f"{Path(settings['model']).name}: SLO TTFT <= {settings['slo_ttft_ms']:g} ms, "
            f"no gap over {settings['slo_itl_ms']:g} ms"
        )
        paths.append(plot_attainment(swept, out / "slo-sweep.png", title=title))
    return paths


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def server_commands(
    args: argparse.Namespace, model: Path, port: int
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each server's argv and environment, with the matched settings."""
    shared = ["-np", str(args.n_parallel), "-c", str(args.n_ctx), "-t", str(args.threads)]
    ours = [sys.executable, "-m", "llamabatch", "serve", "-m", str(model), "--port", str(port), *shared]
    ours += ["--no-access-log", "--log-level", "warning", *shlex.split(args.ours_args)]
    slo = ["--slo-ttft-ms", repr(args.slo_ttft_ms), "--slo-itl-ms", repr(args.slo_itl_ms)]
    binary = args.llama_server_dir / "llama-server"
    theirs = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *shared]
    theirs += shlex.split(args.llama_server_args)
    lib_path = os.pathsep.join(
        p for p in (str(args.llama_server_dir), os.environ.get("LD_LIBRARY_PATH")) if p
    )
    env = dict(os.environ)
    return {
        OURS_SLO: ([*ours, *slo], env),
        LLAMA_SERVER: (theirs, {**env, "LD_LIBRARY_PATH": lib_path}),
        OURS_NO_SLO: (ours, env),
    }


def drop_page_cache(llama_server_dir: Path) -> None:
    """Drop the pinned build's and llama-server's library pages (best effort)."""
    subprocess.run(
        [sys.executable, "-m", "llamabatch", "drop-page-cache", str(llama_server_dir)],
        check=False,
        capture_output=True,
        timeout=120,
    )


def sweep(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every server in turn at its rates; the results written after every point."""
    model = resolve_model(args.model)
    rates = sorted(set(args.rates) | {args.light_rate})
    seeds = {rate: point_seed(args.seed, k) for k, rate in enumerate(rates)}
    plan = [(OURS_SLO, rates), (LLAMA_SERVER, rates), (OURS_NO_SLO, [args.light_rate])]
    if not (args.llama_server_dir / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.llama_server_dir} (--llama-server-dir)")
    results: dict[str, Any] = {
        "settings": {
            "model": str(model),
            "mix": args.mix,
            "requests": args.requests,
            "rates": rates,
            "seeds": {str(k): v for k, v in seeds.items()},
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_itl_ms": args.slo_itl_ms,
            "heavy_rate": args.heavy_rate,
            "light_rate": args.light_rate,
            "server_args": f"-np {args.n_parallel} -c {args.n_ctx} -t {args.threads}",
            "ours_args": args.ours_args,
            "llama_server_args": args.llama_server_args,
        },
        "rows": [],
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for server, server_rates in plan:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv, env = server_commands(args, model, port)[server]
        if not args.no_drop_page_cache:
            drop_page_cache(args.llama_server_dir)
        log(f"slo_sweep: starting {server}: {shlex.join(argv)}")
        server_log = out / f"{LOG_NAMES[server]}.log"
        with running_server(argv, url, server_log, env=env, ready_timeout=args.ready_timeout):
            for rate in server_rates:
                row = measure(
                    url,
                    model,
                    rate,
                    args.requests,
                    mix=args.mix,
                    seed=seeds[rate],
                    slo_ttft_ms=args.slo_ttft_ms,
                    slo_itl_ms=args.slo_itl_ms,
                    timeout=args.request_timeout,
                )
                row["server"] = server
                results["rows"].append(row)
                log(
                    f"slo_sweep: {server} @ {rate:g}/s: SLO met {row['attainment_pct'] or 0:.0f}%, "
                    f"{row['total_tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                    f"ITL p99 {row['itl_p99_ms']:.1f} ms"
                )
                write_results(results, out, plot=False)
    return results


def _mix_text(text: str) -> str:
    """``--mix``, checked by bench-serve's parser and kept as given."""
    try:
        parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct, Q4_1)")
    p.add_argument("--out", type=Path, default=Path("slo-sweep"), help="output directory (default slo-sweep)")
    p.add_argument(
        "--quick", action="store_true", help=f"a smoke run: {QUICK_REQUESTS} requests at rates {QUICK_RATES}"
    )
    p.add_argument(
        "--rates",
        type=options.positive_float_list,
        default=None,
        help=f"req/s, comma list (default {FULL_RATES})",
    )
    p.add_argument("--requests", type=options.positive_int, default=None, help="requests a rate (default 30)")
    p.add_argument(
        "--mix",
        type=_mix_text,
        default=HEAVY_MIX,
        help=f"bench-serve's NPP:NTG[:WEIGHT],... (default {HEAVY_MIX})",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-itl-ms", type=float, default=250.0)
    p.add_argument("--heavy-rate", type=float, default=0.5, help="the heavy-load check's rate (default 0.5)")
    p.add_argument("--light-rate", type=float, default=0.2, help="the light-load check's rate (default 0.2)")
    p.add_argument("-np", "--n-parallel", type=options.positive_int, default=8)
    p.add_argument("-c", "--n-ctx", type=options.positive_int, default=16384)
    p.add_argument("-t", "--threads", type=options.positive_int, default=2)
    p.add_argument(
        "--ours-args",
        default="",
        help="more flags for llamabatch serve (one string; --ours-args=--no-kv-unified)",
    )
    p.add_argument(
        "--llama-server-args",
        default="",
        help="more flags for llama-server (one string; --llama-server-args='-fa on')",
    )
    p.add_argument(
        "--llama-server-dir",
        type=Path,
        default=Path.home() / ".cache" / "llamabatch-anchors",
        help="the directory of llama-server and its libraries (default ~/.cache/llamabatch-anchors)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to load")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--no-drop-page-cache", action="store_true", help="keep the libraries' cached pages")
    p.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="SLO-SWEEP.json",
        help="run nothing: rewrite the table and the plot of an earlier run's JSON into --out",
    )
    args = p.parse_args(argv)
    if args.rates is None:
        args.rates = list(QUICK_RATES if args.quick else FULL_RATES)
    if args.requests is None:
        args.requests = QUICK_REQUESTS if args.quick else 30
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
    else:
        with signals_as_exit():
            results = sweep(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    for path in write_results(results, args.out, plot=not args.no_plot):
        print(f"wrote {path}", file=sys.stderr)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
