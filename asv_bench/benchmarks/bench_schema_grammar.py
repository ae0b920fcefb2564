"""asv: JSON schema → GBNF conversion (``llamabatch.prompts.schema_grammar``).

- ``TimeSchemaToGbnf``: one conversion of an object schema with 10, 100 and 1,000 optional
  properties (each a ``["string", "integer"]`` union), the grammar check excluded;
  ``time_per_property`` divides by the count, so a linear converter shows the same figure
  at every size (the target: within 2x from 10 to 1,000).
- ``TimeJsonSchemaGrammar``: the whole path ``SamplingParams`` takes (``check_schema``, the
  conversion, ``check_grammar``), uncached.

Run ``python asv_bench/benchmarks/bench_schema_grammar.py`` for the figures at once.
"""

from __future__ import annotations

import timeit
from functools import partial
from typing import Any

from llamabatch.prompts.grammar_check import check_grammar, get_grammar_limits
from llamabatch.prompts.schema_grammar import schema_to_gbnf
from llamabatch.prompts.structured import check_schema

SIZES = [10, 100, 1000]


def optional_properties(n: int) -> dict[str, Any]:
    """An object schema with ``n`` optional properties, in declared order."""
    return {
        "type": "object",
        "properties": {f"property_{i}": {"type": ["string", "integer"]} for i in range(n)},
        "additionalProperties": False,
    }


class TimeSchemaToGbnf:
    params = (SIZES,)
    param_names = ("properties",)

    def setup(self, n: int) -> None:
        self.schema = optional_properties(n)
        self.limits = get_grammar_limits()

    def time_convert(self, n: int) -> None:
        schema_to_gbnf(self.schema, what="json_schema", limits=self.limits)

    def track_per_property_us(self, n: int) -> float:
        runs = max(1, 2000 // n)
        seconds = min(timeit.repeat(lambda: self.time_convert(n), number=runs, repeat=3))
        return seconds / runs / n * 1e6

    track_per_property_us.unit = "us"  # type: ignore[attr-defined]


class TimeJsonSchemaGrammar:
    params = (SIZES,)
    param_names = ("properties",)

    def setup(self, n: int) -> None:
        self.schema = optional_properties(n)
        self.limits = get_grammar_limits()

        self.calls = 0

    def time_check_convert_check(self, n: int) -> None:
        self.calls += 1
        what = f"json_schema#{self.calls}"  # check_grammar caches by (grammar, what, limits)
        check_schema(self.schema, what=what, limits=self.limits)
        check_grammar(
            schema_to_gbnf(self.schema, what=what, limits=self.limits), what=what, limits=self.limits
        )


def main() -> None:
    for n in SIZES:
        bench = TimeSchemaToGbnf()
        bench.setup(n)
        per_property = bench.track_per_property_us(n)
        whole = TimeJsonSchemaGrammar()
        whole.setup(n)
        runs = max(1, 200 // n)
        total = min(timeit.repeat(partial(whole.time_check_convert_check, n), number=runs, repeat=3)) / runs
        print(
            f"{n:5d} properties: convert {per_property:6.1f} us/property, "
            f"with both checks {total * 1e3:8.2f} ms"
        )


if __name__ == "__main__":
    main()
