"""The same sampling, token for token, as llama-server: both servers on the same model, the same
``/v1/completions`` requests (greedy with the penalties and DRY, seeded draws with XTC,
top-n-sigma and mirostat), the texts compared.

    llamabatch serve -m model.gguf -t 2 -np 1 --port 8011 &
    llama-server -m model.gguf -t 2 -np 1 --port 8012 &
    python docs/sampler_parity.py --ours http://127.0.0.1:8011 --llama-server http://127.0.0.1:8012

Prints ``SAME`` or ``DIFF`` (with both texts) per request, and exits 1 when any differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from typing import Any

PROMPTS = [
    "one two three four, one two three four, one two three four,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]
GREEDY: list[dict[str, Any]] = [
    {},
    {"repeat_penalty": 1.3},
    {"repeat_penalty": 1.2, "repeat_last_n": 16},
    {"presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"dry_multiplier": 0.8},
    {"dry_multiplier": 1.5, "dry_allowed_length": 3, "dry_sequence_breakers": ["\n"]},
]
SEEDED: list[dict[str, Any]] = [
    {"seed": 3},
    {"seed": 3, "xtc_probability": 0.5, "xtc_threshold": 0.1},
    {"seed": 1, "top_n_sigma": 1.0},
    {"seed": 4, "mirostat": 1},
    {"seed": 4, "mirostat": 2},
    {"seed": 5, "dry_multiplier": 0.8, "top_n_sigma": 2.0, "temperature": 0.9},
]


def completion(url: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ours", required=True, help="llamabatch serve's base URL")
    parser.add_argument("--llama-server", required=True, help="llama-server's base URL")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    cases = [{"temperature": 0, **c} for c in GREEDY] + [{"temperature": 1.0, **c} for c in SEEDED]
    differ = 0
    for prompt in PROMPTS:
        for case in cases:
            body = {"prompt": prompt, "max_tokens": args.max_tokens, **case}
            ours, theirs = completion(args.ours, body), completion(args.llama_server, body)
            differ += ours != theirs
            print("SAME" if ours == theirs else f"DIFF\n  ours {ours!r}\n  llama-server {theirs!r}\n ", case)
    print(f"{differ} of {len(PROMPTS) * len(cases)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
