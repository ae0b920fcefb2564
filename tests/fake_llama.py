"""A fake llama.cpp model and context, honest enough to drive ``EngineCore`` tick by tick.

The scheduler tests (``test_scheduler_fake.py`` and its neighbours) use it in addition to the tests on real
llama.cpp, never instead: it runs in microseconds, is deterministic, and lets a test
script what ``llama_decode`` returns.

What it keeps of llama.cpp's semantics:

- **KV memory.** A unified cache (``kv_unified=True``) is one pool of ``n_ctx`` cells; a
  cell holds a position, a token and a SET of sequence ids. ``seq_cp`` adds ``dst`` to
  the cells of ``src`` in a position range (cells are shared, nothing is copied);
  ``seq_rm`` removes a sequence from cells and frees the cells no sequence holds any more.
  With ``kv_unified=False`` every sequence has a stream of its own, ``n_ctx / n_seq_max``
  cells; ``seq_cp`` between streams copies the whole stream (the destination's stream is
  reset first) and a partial cross-stream copy raises ``FakeLlamaError``: llama.cpp
  aborts the process there (``GGML_ASSERT``).
- **Decode.** ``decode_address`` reads the ``llama_batch`` struct at the given address
  (the core's preallocated batch) and checks it as llama.cpp does: token and sequence ids
  in range, at most ``n_batch`` tokens, and every sequence's positions consecutive,
  continuing at its last position in the KV cache plus one. A violation raises
  ``FakeLlamaError`` (llama.cpp would reject the batch or corrupt the cache: either way
  a bug in the caller). Each token takes a free cell of its sequence's pool; when a pool
  has too few free cells the decode returns 1 with nothing written (llama.cpp prepares
  every micro-batch before computing), or, with ``partial_kv_full=True``, after writing
  the micro-batches (``n_ubatch`` tokens each) that fit, as older llama.cpp did.
- **Scripted codes.** ``script`` is a queue of what the next decodes return: an int
  (returned with nothing written) or ``(code, k)``: the first ``k`` micro-batches are
  written, then ``code`` is returned (a failure midway: llama.cpp removes only the
  failing micro-batch's cells; the caller must remove the rest). ``0`` in the script
  means "decode normally".
- **Logits.** Deterministic and causal: the logits at a batch entry depend only on the
  tokens its sequence holds in the KV cache at positions ``0..pos`` (read from the
  fake's own cells, so a caller that loses or corrupts KV gets other tokens). The argmax
  is ``FakeModel.next_token(tokens)``, so every greedy completion has a known expected
  token sequence (``FakeModel.completion``) however it was batched, preempted or resumed.

``FakeModel``/``FakeContext`` also take the constructor arguments of ``Model``/``Context``
so ``LLMEngine`` and ``LLM`` can be built over them (``patch_llamabatch``).
"""

from __future__ import annotations

import functools
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from llamabatch._ffi import ffi
from llamabatch.config import CACHE_RAM_DEFAULT_MIB, EngineConfig
from llamabatch.generate.core import EngineCore
from llamabatch.generate.engine_build import build_engine
from llamabatch.generate.kv_memory import plan_config
from llamabatch.runtime.telemetry import Telemetry

__all__ = [
    "FakeContext",
    "FakeLlamaError",
    "FakeModel",
    "FakeSampler",
    "make_core",
    "patch_llamabatch",
]

_INF = 2**31 - 1


#: how the fake's sequence-state bytes start
_STATE_MAGIC = b"FAKESEQ1"


class FakeLlamaError(AssertionError):
    """What llama.cpp would reject or abort on: a bug in the code driving the context."""


# -- the model ----------------------------------------------------------------------------


class FakeModel:
    """A vocabulary of ``n_vocab`` tokens and a deterministic "network".

    Token 0 is the one end-of-generation token (``eog_ids``). The greedy next token of a
    sequence is a hash of its tokens and length; with ``natural_eog=False`` it is never an
    end-of-generation token (the id after it is taken), so completions run to
    ``max_tokens``; with ``natural_eog=True`` about one step in ``n_vocab`` ends one.
    Some token pieces are halves of a two-byte UTF-8 character, so incremental
    detokenization is exercised.
    """

    def __init__(
        self,
        path: str | Path = "fake.gguf",
        *,
        n_vocab: int = 64,
        eog_ids: tuple[int, ...] = (0,),
        natural_eog: bool = False,
        is_recurrent: bool = False,
        is_hybrid: bool = False,
        n_swa: int = 0,
        **_ignored: Any,  # Model's n_gpu_layers, load_mode, validate
    ) -> None:
        self.path = Path(path)
        self.n_vocab = n_vocab
        # the hyperparameters the default n_ctx and the KV bytes are computed from
        self.architecture = "fake"
        self.n_ctx_train = 4096
        self.n_layer, self.n_head, self.n_head_kv, self.n_embd = 2, 2, 2, 64
        self.n_params = 100_000  # weighs a ubatch against attended cells (per-stream batch order)
        self.eog_ids = frozenset(eog_ids)
        self.natural_eog = natural_eog
        self.is_recurrent = is_recurrent
        self.is_hybrid = is_hybrid
        self.n_swa = n_swa  # a sliding window (the fake's cache keeps every position)
        self.has_decoder = True
        self.has_encoder = False
        self.generates_text = True
        self.vocab_only = False
        self.closed = False
        # a fixed pattern for the non-peak logits (so sampled requests have a spread)
        self._noise = ((np.arange(n_vocab) * 7919) % 23 / 23.0).astype(np.float32)

    # vocabulary

    def eog_flags(self) -> bytearray:
        return bytearray(1 if t in self.eog_ids else 0 for t in range(self.n_vocab))

    def meta(self, key: str) -> str | None:
        """No GGUF metadata (the KV sizes fall back to n_embd / n_head)."""
        return None

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} out of range")
        if token in self.eog_ids:
            return b"</s>" if special else b""
        if token % 11 == 3:
            return b"\xc3"  # the first byte of "é" ...
        if token % 11 == 4:
            return b"\xa9"  # ... and the second: split across tokens
        return f" w{token}".encode()

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        return [1 + b % (self.n_vocab - 1) for b in data]

    def detokenize(self, tokens: list[int], remove_special: bool = False, unparse: bool = False) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.closed = True

    # the "network"

    def next_token(self, tokens: list[int] | tuple[int, ...]) -> int:
        """The greedy next token after ``tokens`` (the argmax of ``logits``)."""
        h = 17
        for t in tokens:
            h = (h * 31 + t + 1) % 1_000_003
        token = (h + len(tokens)) % self.n_vocab
        if not self.natural_eog:
            while token in self.eog_ids:
                token = (token + 1) % self.n_vocab
        return token

    def logits(self, tokens: list[int]) -> np.ndarray:
        """The logits after ``tokens``: a peak of 4 at ``next_token``, the rest in [0, 1)."""
        row = self._noise.copy()
        row[self.next_token(tokens)] = 4.0
        return row

    def completion(
        self,
        prompt: list[int],
        max_tokens: int,
        n_ctx_seq: int,
        ignore_eos: bool = False,
        sampler: FakeSampler | None = None,
    ) -> tuple[list[int], str]:
        """``(tokens, finish_reason)`` of a completion run alone, as the engine ends it: an
        end-of-generation token ends it ("stop", the token included), ``max_tokens`` or a
        full context ("length": prompt + output reach ``n_ctx_seq``). Greedy, or drawn by
        ``sampler`` (a fresh ``FakeSampler`` with the request's params)."""
        history = list(prompt)
        out: list[int] = []
        while True:
            if sampler is None:
                token = self.next_token(history)
            else:
                token = sampler.sample(_OneRow(self.logits(history)), 0)  # type: ignore[arg-type]
            out.append(token)
            history.append(token)
            if token in self.eog_ids and not ignore_eos:
                return out, "stop"
            if len(out) >= max_tokens or len(history) >= n_ctx_seq:
                return out, "length"


class _OneRow:
    """What a sampler reads from a context: the logits of one output."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def logits_view(self, i: int) -> np.ndarray:
        return self.row


class FakeSampler:
    """A stand-in for ``SamplerChain`` over a fake context: a seeded RNG and a repeat
    penalty history that carry over from call to call (as llama.cpp's chain does)."""

    def __init__(
        self, model: FakeModel, params: Any, *, n_ctx: int | None = None, max_live_stacks: int = 0
    ) -> None:
        self.model = model
        self.params = params
        self.rng = np.random.default_rng(params.seed if params.seed is not None else 0)
        self.history: list[int] = []
        self.calls = 0
        self.closed = False

    def sample(self, context: FakeContext, idx: int) -> int:
        if self.closed:
            raise FakeLlamaError("sampling with a closed sampler chain")
        self.calls += 1
        logits = context.logits_view(idx).astype(np.float64)
        if self.params.repeat_penalty != 1.0 and self.history:
            seen = np.array(sorted(set(self.history)))
            logits[seen] -= np.log(self.params.repeat_penalty)
        if self.params.temperature == 0:
            token = int(np.argmax(logits))
        else:
            z = logits / self.params.temperature
            z -= z[np.isfinite(z)].max()
            p = np.exp(z)
            p /= p.sum()
            token = int(self.rng.choice(len(p), p=p))
        self.history.append(token)
        return token

    def close(self) -> None:
        self.closed = True


# -- the context --------------------------------------------------------------------------


class _Pool:
    """One KV stream: ``size`` cells, each empty (pos -1) or holding (pos, token, seqs)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pos = [-1] * size
        self.tok = [0] * size
        self.seqs: list[set[int]] = [set() for _ in range(size)]
        self.n_used = 0

    def free_cells(self) -> int:
        return self.size - self.n_used

    def take(self) -> int:
        for c in range(self.size):  # the lowest empty cell, as llama.cpp's search from head 0
            if self.pos[c] < 0:
                return c
        raise FakeLlamaError("no free cell")  # callers check room first

    def reset(self) -> None:
        self.__init__(self.size)  # type: ignore[misc]


class FakeContext:
    """A fake ``llamabatch._ffi.context.Context`` (see the module docstring)."""

    def __init__(
        self,
        model: FakeModel,
        *,
        n_ctx: int = 256,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        partial_kv_full: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
        **_ignored: Any,  # Context's n_threads, flash_attn, ...
    ) -> None:
        if not kv_unified and n_ctx % n_seq_max:
            raise ValueError("n_ctx must be a multiple of n_seq_max with one stream per sequence")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch or n_batch, n_batch)
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self.n_ctx_seq = n_ctx if kv_unified else n_ctx // n_seq_max
        self.partial_kv_full = partial_kv_full
        self.type_k, self.type_v = type_k, type_v
        self.has_memory = True
        self.embeddings = False
        if kv_unified:
            self.pools = [_Pool(n_ctx)]
        else:
            self.pools = [_Pool(self.n_ctx_seq) for _ in range(n_seq_max)]
        #: per sequence: position -> cell of its pool
        self.seq_cells: list[dict[int, int]] = [{} for _ in range(n_seq_max)]
        #: what the next decodes return (see the module docstring)
        self.script: deque[int | tuple[int, int]] = deque()
        #: every seq_rm / seq_cp / decode, in order: ("seq_rm", seq, p0, p1),
        #: ("seq_cp", src, dst, p0, p1), ("decode", n_tokens, code)
        self.log: list[tuple[Any, ...]] = []
        #: the batch the context is expected to decode (optional cross-check of addresses)
        self.batch: Any = None
        self.n_decodes = 0
        #: a scripted decode time: (fixed, per token, per output, per attended KV cell) in
        #: seconds; each successful decode advances ``now`` by it (``clock`` reads it)
        self.cost: tuple[float, float, float, float] | None = None
        #: scripted seconds added to a decode of two tokens or more (a CPU's one-token decode
        #: runs matrix-vector kernels, a batch matrix-matrix ones: the second token is dear)
        self.batch_jump = 0.0
        self.now = 0.0
        self._abort = False
        self._logits: np.ndarray | None = None
        self._out_row: dict[int, int] = {}
        self.closed = False

    # -- lifetime, abort --

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self._abort = True

    def clear_abort(self) -> None:
        self._abort = False

    @property
    def abort_requested(self) -> bool:
        return self._abort

    # -- KV memory --

    def _pool(self, seq: int) -> _Pool:
        return self.pools[0] if self.kv_unified else self.pools[seq]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise FakeLlamaError(f"seq_id {seq} out of range 0..{self.n_seq_max - 1}")

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        self.log.append(("seq_rm", seq_id, p0, p1))
        seqs = range(self.n_seq_max) if seq_id == -1 else (seq_id,)
        if seq_id != -1:
            self._check_seq(seq_id)
        lo = 0 if p0 < 0 else p0
        hi = _INF if p1 < 0 else p1
        for seq in seqs:
            self._remove(seq, [p for p in self.seq_cells[seq] if lo <= p < hi])
        return True

    def _remove(self, seq: int, positions: list[int]) -> None:
        pool = self._pool(seq)
        cells = self.seq_cells[seq]
        for p in positions:
            c = cells.pop(p)
            pool.seqs[c].discard(seq)
            if not pool.seqs[c]:
                pool.pos[c] = -1
                pool.n_used -= 1

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.log.append(("seq_cp", src, dst, p0, p1))
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst:
            return
        if self.kv_unified:
            lo = 0 if p0 < 0 else p0
            hi = _INF if p1 < 0 else p1
            pool = self.pools[0]
            for p, c in sorted(self.seq_cells[src].items()):
                if not lo <= p < hi:
                    continue
                other = self.seq_cells[dst].get(p)
                if other is not None and other != c:
                    raise FakeLlamaError(
                        f"seq_cp({src}, {dst}): seq {dst} would hold position {p} in two cells"
                    )
                pool.seqs[c].add(dst)
                self.seq_cells[dst][p] = c
            return
        # Across streams llama.cpp copies whole buffers only (GGML_ASSERT otherwise).
        size = self.n_ctx_seq
        if (p0 > 0 and p0 + 1 < size) or (p1 > 0 and p1 + 1 < size):
            raise FakeLlamaError(
                f"seq_cp({src}, {dst}, {p0}, {p1}) across KV streams: llama.cpp only copies whole "
                "streams (GGML_ASSERT: seq_cp() is only supported for full KV buffers)"
            )
        s_pool, d_pool = self.pools[src], self.pools[dst]
        d_pool.reset()
        self.seq_cells[dst] = {}
        for p, c in self.seq_cells[src].items():
            d_pool.pos[c] = p
            d_pool.tok[c] = s_pool.tok[c]
            d_pool.seqs[c] = {dst}
            d_pool.n_used += 1
            self.seq_cells[dst][p] = c

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        cells = self.seq_cells[seq_id]
        return max(cells) if cells else -1

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        cells = self.seq_cells[seq_id]
        return min(cells) if cells else -1

    # -- sequence state (the host-RAM prompt cache) --

    def state_seq_get(self, seq_id: int, max_bytes: int | None = None) -> bytes:
        """The sequence's (position, token) pairs, as llama_state_seq_get_data's bytes
        (empty when none, or more than ``max_bytes``)."""
        self._check_seq(seq_id)
        self.log.append(("state_get", seq_id))
        pool = self._pool(seq_id)
        pairs = [(p, pool.tok[c]) for p, c in sorted(self.seq_cells[seq_id].items())]
        if not pairs or (max_bytes is not None and len(_STATE_MAGIC) + 8 * len(pairs) > max_bytes):
            return b""
        return _STATE_MAGIC + np.asarray(pairs, dtype=np.int32).reshape(-1).tobytes()

    def state_seq_set(self, seq_id: int, data: bytes) -> bool:
        """Load ``state_seq_get``'s bytes into ``seq_id`` (cleared first, as llama.cpp does);
        False without room or for bytes it did not make."""
        self._check_seq(seq_id)
        self.log.append(("state_set", seq_id, len(data)))
        self._remove(seq_id, list(self.seq_cells[seq_id]))
        if not data.startswith(_STATE_MAGIC) or (len(data) - len(_STATE_MAGIC)) % 8:
            return False
        pairs = np.frombuffer(data[len(_STATE_MAGIC) :], dtype=np.int32).reshape(-1, 2)
        pool = self._pool(seq_id)
        if pool.free_cells() < len(pairs) or (len(pairs) and int(pairs[:, 0].max()) >= self.n_ctx_seq):
            return False
        for p, tok in pairs.tolist():
            c = pool.take()
            pool.pos[c], pool.tok[c], pool.seqs[c] = p, tok, {seq_id}
            pool.n_used += 1
            self.seq_cells[seq_id][p] = c
        return True

    # -- what tests inspect --

    def cells_used(self) -> int:
        """Cells holding some sequence's position, all streams together."""
        return sum(pool.n_used for pool in self.pools)

    def seq_positions(self, seq: int) -> list[int]:
        return sorted(self.seq_cells[seq])

    def seq_tokens(self, seq: int) -> list[int]:
        pool = self._pool(seq)
        cells = self.seq_cells[seq]
        return [pool.tok[cells[p]] for p in sorted(cells)]

    def check(self) -> None:
        """The fake's own consistency: cells and the per-sequence maps agree."""
        for i, pool in enumerate(self.pools):
            used = 0
            for c in range(pool.size):
                if pool.pos[c] < 0:
                    assert not pool.seqs[c], f"empty cell {c} of stream {i} holds seqs"
                    continue
                used += 1
                assert pool.seqs[c], f"cell {c} of stream {i} is used by no sequence"
                for s in pool.seqs[c]:
                    assert self.seq_cells[s].get(pool.pos[c]) == c
            assert used == pool.n_used
        for s, cells in enumerate(self.seq_cells):
            pool = self._pool(s)
            for p, c in cells.items():
                assert pool.pos[c] == p and s in pool.seqs[c]

    # -- decode --

    def decode_address(self, batch_address: int) -> int:
        if self.batch is not None and self.batch.address != batch_address:
            raise FakeLlamaError("decode of a batch at an unexpected address")
        b = ffi.cast("llama_batch *", batch_address)
        n = b.n_tokens
        if n <= 0:
            raise FakeLlamaError("llama_decode: n_tokens == 0")
        if n > self.n_batch:
            raise FakeLlamaError(f"llama_decode: {n} tokens exceed n_batch {self.n_batch}")
        tokens = ffi.unpack(b.token, n)
        pos = ffi.unpack(b.pos, n)
        n_seq = ffi.unpack(b.n_seq_id, n)
        seqs = [tuple(b.seq_id[i][k] for k in range(n_seq[i])) for i in range(n)]
        flags = ffi.unpack(b.logits, n)
        self._check_batch(tokens, pos, seqs)
        self.n_decodes += 1
        self._logits = None
        self._out_row = {}
        entries = list(zip(tokens, pos, seqs, strict=True))
        ubatches = [entries[i : i + self.n_ubatch] for i in range(0, n, self.n_ubatch)]
        if self._abort:
            return self._done(n, 2)
        if self.script:
            step = self.script.popleft()
            code, k = step if isinstance(step, tuple) else (step, 0)
            if code != 0:
                for ub in ubatches[:k]:
                    if not self._fits(ub):
                        break
                    self._write(ub)
                return self._done(n, code)
        if not self._fits(entries):
            if self.partial_kv_full:
                for ub in ubatches:
                    if not self._fits(ub):
                        break
                    self._write(ub)
            return self._done(n, 1)
        self._write(entries)
        if self.cost is not None:
            fixed, per_token, per_output, per_cell = self.cost
            if self.kv_unified:
                attended = n * self.cells_used()
            else:
                attended = sum(p + 1 for p in pos)
            self.now += fixed + per_token * n + per_output * sum(flags) + per_cell * attended
            self.now += self.batch_jump if n > 1 else 0.0
        rows = []
        for i in range(n):
            if flags[i]:
                self._out_row[i] = len(rows)
                rows.append(self.model.logits(self._tokens_through(seqs[i][0], pos[i])))
        self._logits = np.array(rows, dtype=np.float32).reshape(len(rows), self.model.n_vocab)
        return self._done(n, 0)

    def clock(self) -> float:
        """The scripted time (seconds): what ``cost`` made the decodes so far take."""
        return self.now

    def _done(self, n: int, code: int) -> int:
        self.log.append(("decode", n, code))
        return code

    def _check_batch(self, tokens: list[int], pos: list[int], seqs: list[tuple[int, ...]]) -> None:
        per_seq: dict[int, list[int]] = {}
        for i, (t, p, ids) in enumerate(zip(tokens, pos, seqs, strict=True)):
            if not 0 <= t < self.model.n_vocab:
                raise FakeLlamaError(f"batch entry {i}: token id {t} out of range")
            if not ids:
                raise FakeLlamaError(f"batch entry {i}: no seq id")
            if not self.kv_unified and len(ids) > 1:
                raise FakeLlamaError(f"batch entry {i}: one token in several KV streams")
            for s in ids:
                self._check_seq(s)
                per_seq.setdefault(s, []).append(p)
        for s, ps in per_seq.items():
            start = self.seq_pos_max(s) + 1
            if ps != list(range(start, start + len(ps))):
                raise FakeLlamaError(
                    f"seq {s}: batch positions {ps[:4]}... do not continue its KV cache "
                    f"(last position {start - 1}) consecutively"
                )

    def _fits(self, entries: list[tuple[int, int, tuple[int, ...]]]) -> bool:
        need: dict[int, int] = {}
        for _, _, ids in entries:
            key = 0 if self.kv_unified else ids[0]
            need[key] = need.get(key, 0) + 1
        return all(self.pools[k].free_cells() >= m for k, m in need.items())

    def _write(self, entries: list[tuple[int, int, tuple[int, ...]]]) -> None:
        for t, p, ids in entries:
            pool = self._pool(ids[0])
            c = pool.take()
            pool.pos[c] = p
            pool.tok[c] = t
            pool.seqs[c] = set(ids)
            pool.n_used += 1
            for s in ids:
                if p in self.seq_cells[s]:
                    raise FakeLlamaError(f"seq {s}: position {p} written twice")
                self.seq_cells[s][p] = c

    def _tokens_through(self, seq: int, p: int) -> list[int]:
        """The tokens ``seq`` holds at positions 0..p (what attention sees)."""
        pool = self._pool(seq)
        cells = self.seq_cells[seq]
        out = []
        for q in range(p + 1):
            c = cells.get(q)
            if c is None:
                raise FakeLlamaError(f"seq {seq} has no KV cell at position {q} < {p}: lost KV")
            out.append(pool.tok[c])
        return out

    # -- outputs --

    def logits_rows(self, n_rows: int) -> np.ndarray:
        if self._logits is None:
            raise FakeLlamaError("no logits from the last decode")
        if n_rows != len(self._logits):
            raise FakeLlamaError(f"asked for {n_rows} logits rows, the last decode has {len(self._logits)}")
        return self._logits

    def logits_view(self, i: int) -> np.ndarray:
        if self._logits is None or i not in self._out_row:
            raise IndexError(f"no logits at batch index {i}")
        return self._logits[self._out_row[i]]

    def logits_ith(self, i: int) -> np.ndarray:
        return self.logits_view(i).copy()


# -- building engines over the fakes ------------------------------------------------------


def make_core(
    *,
    n_parallel: int = 4,
    n_ctx: int | None = None,
    kv_unified: bool = True,
    prefix_cache: bool = False,
    max_prefixes: int = 0,
    n_batch: int = 64,
    n_ubatch: int | None = None,
    chunk_size: int = 64,
    strategy: Any = "decode_maximal",
    max_queue: int = 1024,
    partial_kv_full: bool = False,
    model: FakeModel | None = None,
    telemetry: Telemetry | None = None,
    target_itl_ms: float | None = None,
    cache_ram: int | None = CACHE_RAM_DEFAULT_MIB,
    speculative_config: dict[str, Any] | None = None,
    priority_aging: int = EngineConfig.priority_aging,
) -> tuple[EngineCore, FakeContext, FakeModel]:
    """An ``EngineCore`` over a fake model and context (``n_ctx``: all cells together;
    default 64 per sequence). The context checks it decodes the core's own batch."""
    model = model or FakeModel()
    n_seq_max = n_parallel + max_prefixes
    config = EngineConfig(
        n_ctx=n_ctx if n_ctx is not None else 64 * n_seq_max,
        n_parallel=n_parallel,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        chunk_size=chunk_size,
        strategy=strategy,
        max_queue=max_queue,
        prefix_cache=prefix_cache,
        max_prefixes=max_prefixes,
        kv_unified=kv_unified,
        target_itl_ms=target_itl_ms,
        cache_ram=cache_ram,
        speculative_config=speculative_config,
        priority_aging=priority_aging,
    )
    # the wiring LLM and LLMEngine use, over a fake context
    config = plan_config(model, config)[1]  # type: ignore[arg-type]
    context, core = build_engine(
        model,  # type: ignore[arg-type]
        config,
        telemetry or Telemetry(),
        context_factory=functools.partial(FakeContext, partial_kv_full=partial_kv_full),  # type: ignore[arg-type]
    )
    assert isinstance(context, FakeContext)
    context.batch = core.batch
    return core, context, model


def patch_llamabatch(monkeypatch: Any, model: FakeModel | None = None, **context_options: Any) -> FakeModel:
    """Make ``LLMEngine``/``LLM`` build fakes instead of llama.cpp objects (pytest's
    ``monkeypatch``); returns the model every engine built from now on uses. The context
    built is kept as ``engine.context``."""
    import llamabatch.generate.engine_build as engine_build
    import llamabatch.generate.llm_engine as llm_engine
    import llamabatch.generate.request_memory as request_memory

    model = model or FakeModel()

    def make_model(path: Any, **_: Any) -> FakeModel:
        model.path = Path(path)
        return model

    def make_context(m: FakeModel, **options: Any) -> FakeContext:
        return FakeContext(m, **{**options, **context_options})

    monkeypatch.setattr(llm_engine, "Model", make_model)
    monkeypatch.setattr(engine_build, "Context", make_context)
    monkeypatch.setattr(request_memory, "SamplerChain", FakeSampler)
    return model
