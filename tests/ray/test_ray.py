"""llamabatch.ray on a real (local, simulated 2-node) Ray cluster made here, with project-made models.

One cluster serves the whole module (Ray starts slowly): a head and a second node of 2 CPUs
each, from ``ray.cluster_utils.Cluster``. Actors are small (tiny model, 1 llama.cpp thread).
The row logic (formats, columns, errors) is also tested in-process, without Ray actors,
through ``Generate.process`` / ``Embed.process``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='the Ray tests need Ray: pip install "llamabatch[ray]"')
pytest.importorskip("ray.data", reason='the Ray tests need Ray Data: pip install "llamabatch[ray]"')
pd = pytest.importorskip("pandas", reason="Ray Data brings pandas")
pa = pytest.importorskip("pyarrow", reason="Ray Data brings pyarrow")

from llamabatch import LLM, Embedder, SamplingParams, testing  # noqa: E402
from llamabatch.ray import Embed, Generate, RowError  # noqa: E402
from llamabatch.ray import bench as ray_bench  # noqa: E402

#: float noise between two batchings of the same greedy request (flash attention off)
LOGPROB_TOLERANCE = 1e-3
MIN_COSINE = 0.9999
GREEDY = {"max_tokens": 8, "temperature": 0, "logprobs": 0}
LLM_OPTIONS = {"n_ctx": 2048, "n_parallel": 8, "n_threads": 1, "flash_attn": False}
EMBED_OPTIONS = {"pooling": "mean", "n_batch": 256, "n_seq_max": 16, "n_threads": 1}

# The node-tagging subclasses below live in this test module, which Ray's workers cannot
# import: ship them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testing.model_path("tiny"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-node simulated cluster (2 CPUs per node), connected; torn down with all its processes.

    Ray's workers put the driver's working directory first on ``sys.path``: the cluster runs
    from an empty directory, so they import the installed llamabatch, never a source tree
    without its compiled extensions (as in CI's fresh clone)."""
    from ray.cluster_utils import Cluster

    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-cwd"))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        c.add_node(num_cpus=2)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        data_context = ray.data.DataContext.get_current()
        data_context.execution_options.preserve_order = True
        data_context.enable_progress_bars = False
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        os.chdir(cwd)


def _prompts(n: int) -> list[str]:
    sentences = testing.english_sentences(64)
    return [" ".join(sentences[i % 64 : i % 64 + 1 + i % 3]) for i in range(n)]


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class _NodeTaggedEmbed(Embed):
    """``Embed`` that also says which node each row was embedded on."""

    def process(self, batch: Any) -> Any:
        out = super().process(batch)
        out["node_id"] = np.full(len(out[self.text_column]), _node_id(), dtype=object)
        return out


def _check_greedy_matches(ray_row: dict[str, Any], local: Any) -> None:
    """The fidelity rule of the engine tests, between two runs of one greedy request: tokens and
    their log-probabilities agree within float noise; where a near-tie made the runs pick
    different tokens, both picks are the argmax within noise, and the comparison ends there."""
    ours = [int(t) for t in ray_row["token_ids"]]
    ours_lp = [float(v) for v in ray_row["logprobs"]]
    theirs = local.outputs[0].token_ids
    theirs_lp = [lp[t] for t, lp in zip(theirs, local.outputs[0].logprobs, strict=True)]
    assert ray_row["prompt_tokens"] == len(local.prompt_token_ids)
    for k in range(min(len(ours), len(theirs))):
        assert ours_lp[k] == pytest.approx(theirs_lp[k], abs=LOGPROB_TOLERANCE)
        if ours[k] != theirs[k]:
            return
    assert ours == theirs
    assert ray_row["generated_text"] == local.outputs[0].text
    assert ray_row["finish_reason"] == local.outputs[0].finish_reason


# -- Ray Data jobs on the 2-node cluster -------------------------------------------------------


def test_generate_200_prompts_two_actors_in_order_matching_in_process(cluster, tiny):
    prompts = _prompts(200)
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    out = ds.map_batches(
        Generate,
        fn_constructor_kwargs={"model": tiny, "sampling_params": GREEDY, **LLM_OPTIONS},
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=25,
    ).take_all()

    assert [row["id"] for row in out] == list(range(200))
    assert [row["prompt"] for row in out] == prompts
    assert all(row["error"] is None for row in out)
    assert all(row["completion_tokens"] == len(row["token_ids"]) > 0 for row in out)

    with LLM(tiny, **LLM_OPTIONS) as llm:
        local = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    for row, reference in zip(out, local, strict=True):
        _check_greedy_matches(row, reference)


def test_embed_500_texts_two_actors_on_both_nodes(cluster, tiny, tmp_path):
    texts = _prompts(500)
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    job = ds.map_batches(
        _NodeTaggedEmbed,
        fn_constructor_kwargs={"model": tiny, **EMBED_OPTIONS},
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=50,
    ).materialize()
    out = job.take_all()

    assert [row["id"] for row in out] == list(range(500))
    assert all(row["error"] is None for row in out)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {row["node_id"] for row in out} == nodes, "the two actors should run on the two nodes"

    vectors = np.stack([row["embedding"] for row in out])
    with Embedder(tiny, **EMBED_OPTIONS) as embedder:
        local = embedder.embed(texts)
    assert vectors.shape == local.shape and vectors.dtype == np.float32
    cosine = np.sum(vectors * local, axis=1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(local, axis=1)
    )
    assert cosine.min() >= MIN_COSINE

    # The files Ray writes agree on every column's type (the error column is a string column
    # even in blocks without an error), so any Parquet reader takes them as one table.
    import pyarrow.dataset

    job.drop_columns(["node_id"]).write_parquet(str(tmp_path))
    files = sorted(tmp_path.glob("*.parquet"))
    assert len({pa.parquet.read_schema(f).field("error").type for f in files}) == 1
    table = pyarrow.dataset.dataset(str(tmp_path)).to_table()
    assert table.num_rows == 500 and table.schema.field("error").type == pa.string()
    got = np.stack(table.sort_by("id").column("embedding").to_numpy(zero_copy_only=False))
    assert np.allclose(got, vectors)


def test_row_errors_land_in_the_error_column(cluster, tiny):
    prompts = ["Hello there", "", None, "word " * 2000, "Good morning"]
    df = pd.DataFrame({"id": range(5), "prompt": prompts})
    out = (
        ray.data.from_pandas(df)
        .map_batches(
            Generate,
            fn_constructor_kwargs={
                "model": tiny,
                "sampling_params": {"max_tokens": 4, "temperature": 0},
                **LLM_OPTIONS,
            },
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_format="pandas",
        )
        .to_pandas()
    )
    assert list(out["id"]) == list(range(5))
    errors = [None if pd.isna(e) else e for e in out["error"]]
    assert errors[0] is None and errors[4] is None
    assert "empty" in errors[1]
    assert "no prompt" in errors[2]
    assert errors[3].startswith("PromptTooLong")
    assert list(out["finish_reason"]) == ["length", "error", "error", "error", "length"]
    assert list(out["completion_tokens"]) == [4, 0, 0, 0, 4]


def test_on_error_raise_fails_the_job(cluster, tiny):
    ds = ray.data.from_items([{"prompt": "fine"}, {"prompt": ""}])
    job = ds.map_batches(
        Generate,
        fn_constructor_kwargs={
            "model": tiny,
            "sampling_params": {"max_tokens": 2},
            "on_error": "raise",
            **LLM_OPTIONS,
        },
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=1,
    )
    with pytest.raises(Exception, match=r"of the batch failed: ValueError: the prompt is empty"):
        job.take_all()


def test_bench_ray_job_and_in_process(cluster, tiny):
    rows = ray_bench.workload("generate", 16)
    remote = ray_bench.ray_job("generate", tiny, rows, actors=1, cpus_per_actor=1, batch_size=4, max_tokens=4)
    local = ray_bench.in_process("generate", tiny, rows, threads=1, max_tokens=4)
    for result in (remote, local):
        assert result.rows == 16 and result.tokens == 16 * 4 and result.rows_per_s > 0
    assert remote.steady_rows == 16 and 0 < remote.steady_s <= remote.seconds
    assert remote.nodes_used == 1
    embedded = ray_bench.in_process("embed", tiny, ray_bench.workload("embed", 8), threads=1)
    assert embedded.rows == 8 and embedded.tokens == 0
    row = remote.row()
    assert {"rows_per_s", "steady_rows_per_s", "gen_tokens_per_s", "load_s"} <= set(row)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: Any) -> tuple[int, Any]:
    """POST JSON (or raw bytes); the status and the JSON answer, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_healthy(url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the proxy answers 404/503 (or nothing) while the route is being set up
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy in {timeout} s")
        time.sleep(0.5)


def _openai_server_available() -> bool:
    try:
        from llamabatch.server import create_app  # noqa: F401
    except ImportError:
        return False
    return True


def test_serve_app(cluster, tiny):
    """The minimal API and (where llamabatch.server is installed) the OpenAI-compatible one,
    as two Serve applications of one replica each."""
    from ray import serve

    from llamabatch.ray import serve_app

    port = _free_port()
    # One proxy: the simulated nodes share this machine's ports.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    common = {"llm_options": LLM_OPTIONS, "embedder_options": EMBED_OPTIONS}
    try:
        minimal = serve_app(
            tiny,
            embedding_model=tiny,
            sampling_params={"max_tokens": 4, "temperature": 0},
            api="minimal",
            **common,
        )
        serve.run(minimal, name="minimal", route_prefix="/m", blocking=False)
        openai = _openai_server_available()
        if openai:
            app = serve_app(
                tiny, embedding_model=tiny, api="openai", server_options={"model_name": "tiny"}, **common
            )
            serve.run(app, name="openai", route_prefix="/o", blocking=False)
        _wait_healthy(f"{base}/m/health")

        status, body = _post(f"{base}/m/v1/generate", {"prompts": ["Hello", "", "Good day"]})
        assert status == 200
        outputs = body["outputs"]
        assert [o["completion_tokens"] for o in outputs] == [4, 0, 4]
        assert outputs[1]["error"] and outputs[0]["error"] is None

        status, body = _post(
            f"{base}/m/v1/generate", {"prompt": "Hello", "sampling_params": {"max_tokens": 2}}
        )
        assert status == 200 and body["outputs"][0]["completion_tokens"] == 2

        with LLM(tiny, **LLM_OPTIONS) as llm:
            local = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert outputs[0]["prompt_tokens"] == len(local[0].prompt_token_ids)

        status, body = _post(f"{base}/m/v1/embed", {"texts": ["one text", "another"]})
        assert status == 200 and len(body["embeddings"]) == 2 and body["errors"] == [None, None]
        with Embedder(tiny, **EMBED_OPTIONS) as embedder:
            expected = embedder.embed(["one text", "another"])
        assert np.allclose(np.asarray(body["embeddings"], dtype=np.float32), expected, atol=1e-4)

        assert _post(f"{base}/m/v1/generate", b"not json")[0] == 400
        assert _post(f"{base}/m/v1/generate", {"prompts": []})[0] == 400
        assert (
            _post(f"{base}/m/v1/generate", {"prompt": "x", "sampling_params": {"max_tokens": -1}})[0] == 400
        )
        assert _post(f"{base}/m/v1/embed", {"nothing": 1})[0] == 400

        if openai:
            _wait_healthy(f"{base}/o/health")
            status, body = _post(
                f"{base}/o/v1/completions",
                {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
            )
            assert status == 200 and body["usage"]["completion_tokens"] == 3
            status, body = _post(
                f"{base}/o/v1/embeddings", {"model": "tiny", "input": ["one text", "another"]}
            )
            assert status == 200
            got = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
            assert np.allclose(got, expected, atol=1e-4)
    finally:
        serve.shutdown()


# -- the row logic, in-process (no actors) -----------------------------------------------------


@pytest.fixture(scope="module")
def generator(tiny):
    g = Generate(tiny, GREEDY, **LLM_OPTIONS)
    yield g
    g.close()


def test_batch_formats_give_the_same_rows(generator):
    prompts = ["The first prompt", "A second one"]
    as_numpy = generator.process({"prompt": np.array(prompts, dtype=object), "k": np.arange(2)})
    as_pandas = generator.process(pd.DataFrame({"prompt": prompts, "k": [0, 1]}))
    as_arrow = generator.process(pa.table({"prompt": prompts, "k": [0, 1]}))
    assert isinstance(as_pandas, pd.DataFrame) and isinstance(as_arrow, pa.Table)
    texts = list(as_numpy["generated_text"])
    assert list(as_pandas["generated_text"]) == texts == as_arrow.column("generated_text").to_pylist()
    assert list(as_numpy["k"]) == [0, 1] and list(as_pandas["k"]) == [0, 1]
    assert as_arrow.column("token_ids").type == pa.list_(pa.int64())
    assert as_arrow.column("logprobs").type == pa.list_(pa.float64())


def test_ray_gets_typed_arrow_blocks(generator):
    """What Ray receives: Arrow, with the output columns typed even when all null."""
    import asyncio

    ok = asyncio.run(generator({"prompt": np.array(["Hello"], dtype=object)}))
    failed = asyncio.run(generator(pd.DataFrame({"prompt": [""]})))
    assert isinstance(ok, pa.Table) and isinstance(failed, pa.Table)
    for name in ("generated_text", "error", "finish_reason", "token_ids", "logprobs", "completion_tokens"):
        assert ok.schema.field(name).type == failed.schema.field(name).type, name
    assert ok.schema.field("error").type == pa.string()
    assert failed.column("generated_text").to_pylist() == [None]


def test_token_id_prompts_and_unicode_column_dtype(generator):
    ids = generator.llm.tokenize("The first prompt")
    by_ids = generator.process(
        {"prompt": np.array([np.asarray(ids, dtype=np.int32)] * 2 + [None], dtype=object)}
    )
    by_text = generator.process({"prompt": np.array(["The first prompt"], dtype="<U32")})
    assert by_ids["generated_text"][0] == by_text["generated_text"][0]
    assert list(by_ids["prompt_tokens"]) == [len(ids), len(ids), 0]


def test_params_column_and_n(tiny):
    with_n = Generate(tiny, {"max_tokens": 3, "temperature": 0.9, "seed": 1, "n": 2}, **LLM_OPTIONS)
    try:
        out = with_n.process({"prompt": np.array(["Hello", ""], dtype=object)})
        assert len(out["generated_text"][0]) == 2 and out["completion_tokens"][0] == [3, 3]
        assert out["finish_reason"][0] == ["length", "length"] and out["error"][1] is not None
    finally:
        with_n.close()
    per_row = Generate(tiny, {"max_tokens": 3, "temperature": 0}, params_column="params", **LLM_OPTIONS)
    try:
        params = np.array([None, {"max_tokens": 5}, {"max_tokens": -1}, {"nope": 1}, {"n": 2}], dtype=object)
        out = per_row.process({"prompt": np.array(["Hello"] * 5, dtype=object), "params": params})
        assert list(out["completion_tokens"]) == [3, 5, 0, 0, 0]
        assert "max_tokens" in out["error"][2] and "nope" in out["error"][3]
        assert "n must be > 1 exactly when" in out["error"][4]
    finally:
        per_row.close()


def test_chat_messages_use_the_chat_template(generator):
    messages = [{"role": "user", "content": "Hello"}]
    out = generator.process({"prompt": np.array([messages], dtype=object)})
    try:
        expected = generator.llm.apply_chat_template(messages)
    except ValueError as exc:  # a model without a chat template: the row says so
        assert str(exc) in out["error"][0]
    else:
        assert out["error"][0] is None
        assert out["prompt_tokens"][0] == len(generator.llm.tokenize(expected, parse_special=True))


def test_raise_mode_names_the_row(tiny):
    g = Generate(tiny, GREEDY, on_error="raise", **LLM_OPTIONS)
    try:
        with pytest.raises(RowError, match=r"row 1 of the batch failed.*empty") as info:
            g.process({"prompt": np.array(["fine", "", "fine"], dtype=object)})
        assert info.value.row == 1
        with pytest.raises(RowError, match=r"row 0 .*PromptTooLong"):
            g.process({"prompt": np.array(["word " * 2000], dtype=object)})
    finally:
        g.close()


def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="every node"):
        Generate(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="every node"):
        Embed(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="on_error"):
        Generate(tiny, on_error="ignore")
    with pytest.raises(TypeError, match="unknown SamplingParams"):
        Generate(tiny, {"max_token": 3})


def test_missing_column_names_the_columns(generator):
    with pytest.raises(KeyError, match=r"no column 'prompt'.*'text'"):
        generator.process({"text": np.array(["x"], dtype=object)})


def test_embed_row_errors_and_formats(tiny):
    e = Embed(tiny, **{**EMBED_OPTIONS, "n_batch": 64})
    try:
        texts = ["short", "word " * 200, None, 7, "also short"]
        out = e.process({"text": np.array(texts, dtype=object)})
        vectors, errors = out["embedding"], list(out["error"])
        assert vectors.shape == (5, e.embedder.n_embd) and vectors.dtype == np.float32
        assert errors[0] is None and errors[4] is None
        assert errors[1].startswith("PromptTooLong: the text has") and "no text" in errors[2]
        assert "TypeError" in errors[3]
        assert np.isnan(vectors[1:4]).all() and not np.isnan(vectors[[0, 4]]).any()
        alone = e.embedder.embed(["short", "also short"])
        assert np.allclose(vectors[[0, 4]], alone, atol=1e-5)

        table = e.process(pa.table({"text": ["a", "b"]}))
        assert table.column("embedding").type == pa.list_(pa.float32(), e.embedder.n_embd)
        frame = e.process(pd.DataFrame({"text": ["a", "b"]}))
        assert np.allclose(np.stack(frame["embedding"]), np.stack(table.column("embedding").to_numpy(False)))
    finally:
        e.close()
    with pytest.raises(RowError, match="row 1"):
        raising = Embed(tiny, on_error="raise", **EMBED_OPTIONS)
        try:
            raising.process({"text": np.array(["ok", None], dtype=object)})
        finally:
            raising.close()


def test_embed_pooling_none_gives_token_arrays(tiny):
    e = Embed(tiny, **{**EMBED_OPTIONS, "pooling": "none"})
    try:
        out = e.process({"text": np.array(["two words", "three more words"], dtype=object)})
        shapes = [v.shape for v in out["embedding"]]
        assert [s[0] for s in shapes] == [
            len(e.embedder.tokenize(t)) for t in ("two words", "three more words")
        ]
        assert not math.isnan(float(out["embedding"][0][0, 0]))
    finally:
        e.close()


def test_bench_arguments_parse():
    import argparse

    parser = argparse.ArgumentParser()
    ray_bench.add_arguments(parser)
    args = parser.parse_args(["--kind", "embed", "--nodes", "1,2,4", "-n", "64", "--no-scaling"])
    assert args.nodes == [1, 2, 4] and args.rows == 64 and args.no_scaling
    assert Path(ray_bench.__file__).name == "bench.py"
