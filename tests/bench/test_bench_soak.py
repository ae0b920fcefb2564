"""``llamabatch bench-soak`` (issue 11): a small soak on the tiny model holds every invariant,
the accounting catches what it is there to catch, and the engine bugs the soak found stay
fixed (submissions racing ``close()``, in ``LLM`` and ``Embedder``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from llamabatch import LLM, EngineClosed, SamplingParams
from llamabatch.bench.soak import Ledger, Life, SoakConfig


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    # In a subprocess: a crash inside llama.cpp fails the test instead of killing pytest.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_a_small_soak_holds_every_invariant(tiny_path):
    argv = ["-m", "llamabatch", "bench-soak", "-m", str(tiny_path), "--requests", "200", "--threads", "4"]
    argv += ["--close-every", "70", "--fault-rate", "0.03", "--timeout", "30", "--json"]
    run = _run(argv, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    total = next(r for r in rows if r.get("layout") == "all")
    assert total["violations"] == 0
    assert total["prompts_attempted"] == 200
    assert total["prompts_submitted"] + total["refused"] + total["refused_queue_full"] == 200
    assert total["completions_submitted"] >= total["prompts_submitted"]  # n > 1 among them
    assert total["ended_exactly_once"] == total["completions_submitted"] == total["completions_ended"]
    assert total["ended_more_than_once"] == total["never_ended"] == total["finish_reason_mismatches"] == 0
    assert total["kv_cells_used_end"] == 0 and total["seq_pos_max_end"] == -1
    assert (total["lives"], total["closes"], total["drained_closes"]) == (3, 3, 2)
    # faults hit batches, whose requests ended "error"; the engine kept serving
    assert total["faults_injected"] >= 1
    assert total["faults_injected"] == total["faults_consumed"] + total["faults_absorbed_by_close"]
    assert total["ended_error"] >= total["faults_consumed"] and total["unexplained_errors"] == 0
    assert total["ended_cancelled"] > 0 and total["ended_length"] > 0
    assert set(total["modes"]) == {"submit", "iterate", "generate", "stream", "agenerate", "astream"}
    assert total["rss_end_mb"] > 0 and total["rss_growth_mb"] is not None
    layouts = {r["layout"].split()[0]: r for r in rows if r.get("runner") == "soak" and r["layout"] != "all"}
    assert set(layouts) == {"unified", "split"}
    checks = [r for r in rows if r.get("runner") == "check"]
    assert checks and all(r["ok"] for r in checks)


def test_a_lost_end_is_reported_not_waited_for(tiny_path):
    # A request whose end never reaches its caller (the engine's last publish dropped): the
    # soak must report it within its timeout and exit, not hang.
    script = textwrap.dedent(
        f"""
        import sys
        import llamabatch.generate.request as rq
        from llamabatch.bench.soak import SoakConfig, run_soak
        publish, ends = rq.Request.publish, [0]
        def lossy(self, text, token_ids, finish_reason):
            if finish_reason is not None:
                ends[0] += 1
                if ends[0] == 30:
                    return  # lost
            return publish(self, text, token_ids, finish_reason)
        rq.Request.publish = lossy
        config = SoakConfig(model={str(tiny_path)!r}, requests=120, threads=3, close_every=40,
                            timeout=3.0, fault_rate=0.0, progress=False)
        result = run_soak(config)
        for v in result.violations:
            print("VIOLATION", v.splitlines()[0])
        sys.exit(0 if result.ok else 1)
        """
    )
    run = _run(["-c", script], timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert "VIOLATION" in run.stdout
    assert any(w in run.stdout for w in ("hang", "did not end", "probe request failed")), run.stdout


def _life(index: int = 0) -> Life:
    life = Life(index, unified=True, drained=True)
    life.completions = 3
    return life


def test_the_ledger_catches_lost_double_and_misreported_ends():
    ledger = Ledger()
    life = _life()
    ledger.end((1, 0), "length", 0)
    ledger.learn((1, 0), "length")  # fine
    ledger.end((2, 0), "stop", 0)
    ledger.end((2, 0), "cancelled", 0)  # ended twice
    ledger.learn((2, 0), "stop")
    ledger.learn((3, 0), None)  # never ended
    ledger.settle([life], "the test")
    text = "\n".join(ledger.violations)
    assert "1 completions ended more than once" in text
    assert "1 completions had not ended by the test" in text
    assert (life.ended_once, life.ended_more) == (1, 1)
    assert (ledger.n_twice, ledger.n_never, ledger.n_known) == (1, 1, 3)

    ledger = Ledger()
    ledger.end((4, 0), "length", 0)
    ledger.learn((4, 0), "stop")  # the caller saw another reason than the engine's
    ledger.end((5, 1), "cancelled", 0)  # an end nobody claimed, and no anonymous submission
    ledger.settle([_life()], "the test")
    text = "\n".join(ledger.violations)
    assert "another finish reason" in text and "claimed by no caller" in text

    ledger = Ledger()
    ledger.end((6, 0), "cancelled", 0)
    ledger.anonymous = 1  # a cancelled task's completion: its end is the unclaimed one
    ledger.settle([_life()], "the test")
    assert ledger.violations == [] and ledger.n_anonymous == 1


def test_soak_config_is_checked():
    with pytest.raises(ValueError, match="requests"):
        SoakConfig(requests=0)
    with pytest.raises(ValueError, match="cancel_rate"):
        SoakConfig(cancel_rate=2.0)
    with pytest.raises(ValueError, match="unified_n_ctx"):
        SoakConfig(unified_n_ctx=16)


# ------------------------------------------------------------------------------------------
# Engine bugs the soak found: submissions racing close()
# ------------------------------------------------------------------------------------------


def test_generate_on_a_closed_llm_raises_engine_closed(tiny_path):
    # generate() tokenized before checking: ValueError('the model is closed'), not EngineClosed.
    llm = LLM(tiny_path, n_ctx=256, n_parallel=2, n_threads=1)
    llm.close()
    with pytest.raises(EngineClosed):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(EngineClosed):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(EngineClosed):
        llm.submit("hello")


def _race_close(make: str, use: str, settle: float) -> None:
    """Three threads call ``use`` on the object ``make`` builds while the main thread closes
    it, five times over, in a subprocess: no crash, and nothing but ``EngineClosed`` raised."""
    script = textwrap.dedent(
        f"""
        import threading, time, collections
        from llamabatch import LLM, Embedder, SamplingParams, EngineClosed
        text = "the quick brown fox jumps over the lazy dog " * 3000  # slow to tokenize
        other = collections.Counter()
        for cycle in range(5):
            target = {make}
            stop = threading.Event()
            def hammer():
                while not stop.is_set():
                    try:
                        {use}
                    except EngineClosed:
                        pass
                    except Exception as exc:
                        other[repr(exc)] += 1
            threads = [threading.Thread(target=hammer) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep({settle})
            target.close()
            time.sleep(0.01)
            stop.set()
            for t in threads:
                t.join()
        print("OTHER", dict(other))
        """
    )
    run = _run(["-c", script], timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}: " + run.stderr[-2000:]
    assert "OTHER {}" in run.stdout, run.stdout


def test_submissions_racing_close_never_crash(tiny_path):
    # Tokenizing a prompt on a caller's thread while close() freed the model on the engine
    # thread was a use after free: a segfault within the first close, every time.
    _race_close(
        f"LLM({str(tiny_path)!r}, n_ctx=512, n_parallel=2, n_threads=1)",
        "target.submit(text, SamplingParams(max_tokens=1, truncate=True))",
        settle=0.02,
    )


def test_embed_racing_close_never_crashes(tiny_path):
    # The Embedder's twin of that race (tokenizing in embed() while close() frees the model).
    _race_close(
        f"Embedder({str(tiny_path)!r}, truncate=True, n_threads=1)", "target.embed([text])", settle=0.05
    )
