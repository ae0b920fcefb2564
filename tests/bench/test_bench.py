"""The ``llamabatch bench*`` commands on the tiny model, their shared report format, the
workloads, ``bench-serve`` against a small OpenAI-shaped server of the test's own, and the
memory check."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from llamabatch.bench import report, workloads
from llamabatch.cli import main

REQUIRED = {"npp", "ntg", "npl", "total_tokens_per_s", "gen_tokens_per_s"}


@pytest.fixture(scope="module")
def vocab(tiny_path):
    model = workloads.open_tokenizer(tiny_path)
    yield model
    model.close()


def _json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --------------------------------------------------------------------------- llamabatch bench


def test_bench_cli_json_raw_and_llama_cpp_python(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "1,2", "--npp", "8", "--ntg", "4", "-t", "2"]
    assert main([*argv, "--json", "--raw", "--compare", "llama-cpp-python", "--no-progress"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert len(rows) == 6
    assert {(r["runner"], r["npl"]) for r in rows} == {
        (runner, npl) for runner in ("llamabatch", "raw", "llama-cpp-python") for npl in (1, 2)
    }
    for row in rows:
        assert REQUIRED <= row.keys()
        assert (row["npp"], row["ntg"], row["workload"], row["model"]) == (8, 4, "batched", tiny_path.name)
        assert row["prompt_tokens"] == 8 * row["npl"]
        assert row["gen_tokens"] == 4 * row["npl"]
        assert row["total_tokens_per_s"] > row["gen_tokens_per_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] >= 0
    for row in rows:
        if row["runner"] == "llamabatch":
            for key in ("vs_raw_total", "vs_raw_gen", "vs_llama_cpp_python_total", "vs_llama_cpp_python_gen"):
                assert row[key] > 0
            assert 0 <= row["outside_decode_share"] <= 1
            assert row["ticks"] >= 4


def test_bench_cli_table(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "2", "--npp", "8", "--ntg", "4", "-t", "2", "--raw"]
    assert main([*argv, "--no-progress", "--stream", "--kv-unified", "off", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "| llamabatch |" in out and "raw |" in out
    assert "S t/s" in out and "TTFT p50" in out and "kv_unified off" in out
    assert "llamabatch vs" in out  # the ratio table
    assert "note: llamabatch: itl: streamed" in out


def test_bench_cli_kv_types_reach_the_engine(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "2", "--npp", "8", "--ntg", "4", "-t", "2"]
    assert main([*argv, "--no-progress", "-fa", "on", "-ctk", "bf16", "-ctv", "bf16"]) == 0
    assert "kv_types bf16/bf16" in capsys.readouterr().out


def test_bench_cli_more_requests_than_slots(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--npl", "2", "--requests", "5", "--npp", "8", "--ntg", "3"]
    assert main([*argv, "-t", "2", "--raw", "--json", "--no-progress"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [(r["runner"], r["npl"], r["n_requests"], r["gen_tokens"]) for r in rows] == [
        ("llamabatch", 2, 5, 15),
        ("raw", 2, 5, 15),
    ]


def test_bench_cli_mixed_workload(tiny_path, capsys):
    argv = ["bench", "-m", str(tiny_path), "--workload", "mixed", "--requests", "6", "--rate", "200"]
    argv += ["--mix", "8:4,16:2:2", "--n-parallel", "3", "-t", "2", "--json", "--no-progress"]
    assert main([*argv, "--compare", "llama-cpp-python"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [r["runner"] for r in rows] == ["llamabatch", "llama-cpp-python"]
    for row in rows:
        assert REQUIRED <= row.keys()
        assert row["workload"] == "mixed" and row["rate"] == 200 and row["n_requests"] == 6
        assert row["mix"] == "8:4:1,16:2:2"
    assert rows[0]["gen_tokens"] == rows[1]["gen_tokens"]


def test_bench_cli_errors(tiny_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "-m", str(tiny_path), "--npl", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--npl" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "-m", "/nonexistent.gguf"]) == 1
    assert "no model file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "-m", str(tiny_path), "--plot", "out.png"]) == 1
    assert "pip install 'llamabatch[plot]'" in capsys.readouterr().err


def test_bench_plot(tiny_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    argv = ["bench", "-m", str(tiny_path), "--npl", "1,2", "--npp", "8", "--ntg", "2", "-t", "2"]
    assert main([*argv, "--raw", "--no-progress", "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000


# --------------------------------------------------------------------------- the other commands


def test_bench_embed_json_and_sweep(tiny_path, capsys):
    argv = ["bench-embed", "-m", str(tiny_path), "--n", "20", "--compare", "", "-t", "1", "--json"]
    assert main([*argv, "--no-concurrency"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [(r["workload"], r["runner"], r["n_texts"], r["model"]) for r in rows] == [
        ("embed", "llamabatch", 20, tiny_path.name)
    ]
    assert rows[0]["texts_per_s"] > 0
    sweep = ["bench-embed", "-m", str(tiny_path), "--n", "20", "-t", "1", "--sweep"]
    assert main([*sweep, "-b", "128,256", "--n-seq-max", "8", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "| n_batch | n_seq_max |" in out and "tok/pack" in out
    assert main([*argv, "-b", "64,128"]) == 1
    assert "need --sweep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--compare", "faiss"])
    assert "unknown contender" in capsys.readouterr().err


def test_bench_prefix_rows_and_report(tiny_path):
    from llamabatch.bench import prefix

    shared = {"n_requests": 4, "system_tokens": 48, "unique_tokens": 4, "new_tokens": 2}
    chat = {"n_conversations": 2, "n_turns": 2, "system_tokens": 16, "user_tokens": 4}
    rows = prefix.compare(str(tiny_path), shared=shared, chat=chat, n_threads=1)
    assert [(r["workload"], r["prefix_cache"]) for r in rows] == [
        ("shared_system_prompt", "off"),
        ("shared_system_prompt", "on"),
        ("multi_turn_chat", "off"),
        ("multi_turn_chat", "on"),
    ]
    result = prefix.prefix_report(rows, {"model": tiny_path.name})
    lines = [json.loads(line) for line in report.json_lines(result.json_rows())]
    for off, on in (lines[0:2], lines[2:4]):
        assert on["prefill_tokens"] < off["prefill_tokens"] == off["prompt_tokens"]
        assert on["vs_off_computed"] == on["prefill_tokens"] / off["prefill_tokens"]
        assert on["vs_off_time"] == off["t_total_s"] / on["t_total_s"] and on["model"] == tiny_path.name
    text = result.text()
    assert "| reuse on vs |" in text and "T s (off/on)" in text and "note: multi-turn chat" in text


# --------------------------------------------------------------------------- report, workloads


def test_format_table_and_ratios():
    def row(runner, total, gen):
        return {
            "workload": "batched",
            "runner": runner,
            "npp": 8,
            "ntg": 4,
            "npl": 2,
            "total_tokens_per_s": total,
            "gen_tokens_per_s": gen,
            "ttft_p50_ms": 1.0,
        }

    rows = [row("llamabatch", 300.0, 100.0), row("raw", 310.0, 110.0), row("llama-cpp-python", 100.0, 25.0)]
    ratios = report.ratio_rows(rows, subject="llamabatch")
    assert {r["baseline"]: round(r["gen_ratio"], 3) for r in ratios} == {
        "raw": round(100 / 110, 3),
        "llama-cpp-python": 4.0,
    }
    assert rows[0]["vs_llama_cpp_python_total"] == 3.0
    columns = report.ratio_columns("llamabatch vs", [report.Column("npl", "B", "d")], [("gen", "gen t/s")])
    table = report.format_table(ratios, columns).splitlines()
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["llamabatch vs", "B", "gen t/s"]
    assert table[3] == "| llama-cpp-python | 2 |   4.00x |"
    # Columns no row has are left out; a missing value is "-".
    text = report.format_table([{"runner": "a", "rate": None}], report.GENERATION_COLUMNS)
    assert text.splitlines()[0] == "| runner | rate/s |" and "|      a |      - |" in text
    inverse = report.ratio_rows(rows, subject="raw", metrics={"t": "ttft_p50_ms"}, inverse=["t"])
    assert {r["baseline"]: r["t_ratio"] for r in inverse} == {"llamabatch": 1.0, "llama-cpp-python": 1.0}


def test_report_json_lines_carry_the_settings():
    rows = [{"runner": "x", "value": float("nan")}]
    extra = [{"runner": "y", "value": 1.0}]
    r = report.Report({"model": "m"}, rows, [report.Column("value", "v")], extra=[("more", extra, [])])
    assert [json.loads(line) for line in report.json_lines(r.json_rows())] == [
        {"runner": "x", "value": None, "model": "m"},
        {"runner": "y", "value": 1.0, "model": "m"},
    ]
    assert r.text().splitlines()[0] == "model m"


def test_make_prompts_exact_lengths_distinct_starts(vocab):
    prompts = workloads.make_prompts(vocab, [8, 16, 1, 64] * 4, seed=3)
    assert [len(p) for p in prompts] == [8, 16, 1, 64] * 4
    assert len({p[0] for p in prompts}) == len(prompts)
    assert prompts == workloads.make_prompts(vocab, [8, 16, 1, 64] * 4, seed=3)
    assert all(0 <= t < vocab.n_vocab for p in prompts for t in p)


def test_mixed_requests_and_mix(vocab):
    mix = workloads.parse_mix("8:4, 32:2:3")
    assert mix == ((8, 4, 1.0), (32, 2, 3.0))
    requests = workloads.mixed_requests(vocab, 50, rate=10.0, mix=mix, seed=1)
    arrivals = [r.arrival for r in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert {(len(r.prompt), r.max_tokens) for r in requests} == {(8, 4), (32, 2)}
    for bad in ("8", "8:x", "0:4", "8:4:-1", ""):
        with pytest.raises(ValueError):
            workloads.parse_mix(bad)


def test_each_point_gets_prompts_of_its_own(vocab):
    """Rates, grid points and capacity probes draw their prompts from their own seed: a
    server's prompt cache cannot serve one point from an earlier point's identical prompts."""
    assert workloads.point_seed(5, 0) == 5
    mix = workloads.parse_mix("64:4")
    first, second = (
        workloads.mixed_requests(vocab, 6, rate=1.0, mix=mix, seed=workloads.point_seed(1, k)) for k in (0, 1)
    )
    assert {r.prompt for r in first}.isdisjoint({r.prompt for r in second})


def test_batched_requests_count(vocab):
    assert len(workloads.batched_requests(vocab, 8, 2, 4)) == 4
    more = workloads.batched_requests(vocab, 8, 2, 4, n_requests=9)
    assert len(more) == 9 and len({r.prompt for r in more}) == 9
    assert more[:4] == workloads.batched_requests(vocab, 8, 2, 4)  # the same first prompts


# --------------------------------------------------------------------------- bench-serve


class _FakeServer:
    """An OpenAI-shaped ``/v1/completions`` server that streams ``max_tokens`` one-token
    chunks (``tokens_short`` fewer when set), a closing chunk with the finish reason, the
    usage and ``[DONE]``; it records the request bodies and the most requests in flight."""

    def __init__(self, *, status: int = 200, tokens_short: int = 0, delay: float = 0.002) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

            def _json(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if status != 200:
                        self._json(
                            status, {"error": {"message": "bad prompt", "type": "invalid_request_error"}}
                        )
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    n = max(body["max_tokens"] - tokens_short, 1)

                    def event(payload: Any) -> None:
                        data = payload if isinstance(payload, str) else json.dumps(payload)
                        self.wfile.write(f"data: {data}\n\n".encode())
                        self.wfile.flush()

                    for k in range(n):
                        time.sleep(delay)
                        event({"choices": [{"index": 0, "text": f" t{k}", "finish_reason": None}]})
                    event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                    event({"choices": [], "usage": usage})
                    event("[DONE]")
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server() -> Iterator[_FakeServer]:
    server = _FakeServer()
    yield server
    server.close()


def test_bench_serve_batched(tiny_path, fake_server, capsys):
    argv = ["bench-serve", "--url", fake_server.url, "-m", str(tiny_path), "--npp", "8", "--ntg", "4"]
    assert main([*argv, "--npl", "1,3", "--requests", "6", "--json", "--no-progress"]) == 0
    rows = _json_rows(capsys.readouterr().out)
    assert [(r["runner"], r["npl"], r["n_requests"]) for r in rows] == [("server", 1, 6), ("server", 3, 6)]
    for row in rows:
        assert REQUIRED <= row.keys() and row["served_model"] == "fake-model"
        assert (row["prompt_tokens"], row["gen_tokens"]) == (6 * 8, 6 * 4)
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0 and row["total_tokens_per_s"] > 0
    assert fake_server.max_in_flight == 3  # 3 clients at most, each sending its next request
    body = fake_server.bodies[-1]
    assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"]
    assert body["max_tokens"] == 4 and body["temperature"] == 0
    assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])
    # The same prompts as `llamabatch bench` would make for the point (the second: its own seed).
    vocab = workloads.open_tokenizer(tiny_path)
    try:
        seed = workloads.point_seed(0, 1)
        expected = {r.prompt for r in workloads.batched_requests(vocab, 8, 4, 3, seed, n_requests=6)}
    finally:
        vocab.close()
    assert {tuple(b["prompt"]) for b in fake_server.bodies[-6:]} == expected


def test_bench_serve_compare_in_process(tiny_path, fake_server, capsys):
    argv = ["bench-serve", "--url", fake_server.url, "-m", str(tiny_path), "--npp", "8", "--ntg", "4"]
    assert main([*argv, "--npl", "2", "-t", "2", "--compare", "in-process", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| in-process |" in out and "     server |" in out and "|  server vs |" in out
    assert "served_model fake-model" in out and "n_batch 512" in out
    assert main([*argv, "--npl", "2", "-t", "2", "--compare", "in-process", "--no-progress", "--json"]) == 0
    rows = {r["runner"]: r for r in _json_rows(capsys.readouterr().out)}
    assert rows["server"]["vs_in_process_total"] > 0
    assert rows["server"]["gen_tokens"] == rows["in-process"]["gen_tokens"] == 8


def test_bench_serve_mixed(tiny_path, fake_server, capsys):
    argv = ["bench-serve", "--url", fake_server.url, "-m", str(tiny_path), "--workload", "mixed"]
    argv += ["--requests", "8", "--rate", "500", "--mix", "8:3,4:2", "--max-concurrency", "2"]
    assert main([*argv, "--json", "--no-progress", "--no-warmup"]) == 0
    (row,) = _json_rows(capsys.readouterr().out)
    assert (row["runner"], row["workload"], row["rate"], row["n_requests"]) == ("server", "mixed", 500, 8)
    assert fake_server.max_in_flight <= 2
    assert row["gen_tokens"] == sum(b["max_tokens"] for b in fake_server.bodies)


def test_bench_serve_errors(tiny_path, capsys):
    argv = ["-m", str(tiny_path), "--npl", "2", "--npp", "8", "--ntg", "4", "--no-progress"]
    server = _FakeServer(status=400)
    try:
        assert main(["bench-serve", "--url", server.url, *argv]) == 1
        err = capsys.readouterr().err
        assert "answered 400" in err and "bad prompt" in err and len(err.strip().splitlines()) == 1
    finally:
        server.close()
    server = _FakeServer(tokens_short=1)
    try:
        assert main(["bench-serve", "--url", server.url, *argv]) == 1
        assert "honour ignore_eos" in capsys.readouterr().err
    finally:
        server.close()
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", *argv]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


# --------------------------------------------------------------------------- memory


def test_rss_flat_from_100_to_2000_requests():
    from llamabatch.bench.memory import rss_after_requests

    rss = rss_after_requests("tiny", (100, 2000), n_threads=2)
    growth = rss[2000] / rss[100] - 1.0
    assert growth <= 0.05, f"RSS grew {growth:.1%} from 100 to 2,000 requests ({rss})"
