"""Benchmarks of llamabatch against its peers (``llamabatch bench*``, the asv suites).

One module per concern:

- :mod:`~llamabatch.bench.workloads`: the generation workloads (batched, mixed Poisson
  arrivals), made of prompt token ids so that every runner does the same work;
- :mod:`~llamabatch.bench.runners`: what serves them: the engine, a raw static batch through
  the binding, llama-cpp-python, an OpenAI-compatible server over HTTP (and the embedding
  contenders);
- :mod:`~llamabatch.bench.report`: results and the one output format of every command (a
  Markdown table plus ratios, or JSON lines), :mod:`~llamabatch.bench.plots`: the figures;
- the commands, each with its ``add_arguments(parser)`` and ``main(args)``:
  :mod:`~llamabatch.bench.generate` (``llamabatch bench``), :mod:`~llamabatch.bench.serve`
  (``bench-serve``), :mod:`~llamabatch.bench.embed` (``bench-embed``),
  :mod:`~llamabatch.bench.prefix` (``bench-prefix``); :mod:`~llamabatch.bench.options` holds
  the argument types and groups they share;
- :mod:`~llamabatch.bench.memory`: RSS growth over many requests.
"""
