"""asv: what an image request leaves behind for the text streams after it.

``TextAfterImage``: one text stream's generation tokens/s (greedy, 64 tokens, best of 3,
after its first token) right after an image request, over the same before it, on the
random-weight vision model of the 135M test shape (``testing.make_vision_model``; 2 threads
by default). The image encoder runs on a thread of its own; while that thread kept its OpenMP
workers, the process held more of them than cores, libgomp throttled every thread's spin-wait
and every later decode was slower for good (0.42x here, 2.7x slower with SmolLM2 on 2
cores). The target is 1.0 (0.96-1.00x measured).
"""

from __future__ import annotations

import os
import time

import numpy as np

from llamabatch import LLM, SamplingParams
from llamabatch.gguf.testing import PRESETS
from llamabatch.gguf.testing_vision import VisionSpec
from llamabatch.testing import make_vision_model


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", min(2, os.cpu_count() or 1)))


def _text_rate(llm: LLM, rounds: int = 3) -> float:
    """The best of ``rounds`` runs of one stream's generation tokens/s after its first token."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(rounds):
        first = None
        n = 0
        for _ in llm.stream("Tell me a long story about a cat.", params):
            if first is None:
                first = time.perf_counter()
            n += 1
        assert first is not None
        best = max(best, (n - 1) / (time.perf_counter() - first))
    return best


class TextAfterImage:
    timeout = 300
    number = 1
    repeat = 1

    def setup(self) -> None:
        # the 135M test shape: a tiny model's decode is mostly Python's time, and too noisy
        self.model, self.mmproj = make_vision_model(spec=VisionSpec(text=PRESETS["135m"]))

    def track_rate_after_over_before(self) -> float:
        image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        prompt = {"prompt": "<__media__>\nWhat is in the image?", "multi_modal_data": {"image": image}}
        with LLM(self.model, mmproj=str(self.mmproj), n_threads=_threads(), n_parallel=2) as llm:
            before = _text_rate(llm)
            llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
            return _text_rate(llm) / before

    track_rate_after_over_before.unit = "x"  # type: ignore[attr-defined]


if __name__ == "__main__":
    case = TextAfterImage()
    case.setup()
    print(f"text after an image / before: {case.track_rate_after_over_before():.2f}x")
