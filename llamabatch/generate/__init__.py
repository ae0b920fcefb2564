"""Text generation: the engine core and its two drivers.

- :mod:`~llamabatch.generate.core`: ``EngineCore`` (one ``llama_decode`` per ``step()``);
- :mod:`~llamabatch.generate.engine_build`: ``build_engine`` (the context and core of an
  ``EngineConfig``);
- :mod:`~llamabatch.generate.slot_map`: ``SlotMap`` (which request runs in which slot);
- :mod:`~llamabatch.generate.request`: ``Request`` (engine side), ``OutputState`` (the
  caller's side: text pipeline, delivery), ``Channel``, ``RequestHandle``, ``CoreOutput``
  (what one step produced for one completion);
- :mod:`~llamabatch.generate.kv_cache`: KV changes (placement, prefix reuse, pinning, eviction);
- :mod:`~llamabatch.generate.detok`: incremental detokenization and stop strings;
- :mod:`~llamabatch.generate.llm_engine`: ``EngineHost`` (model, context, core, prompts to
  requests) and ``LLMEngine`` (the caller's loop);
- :mod:`~llamabatch.generate.llm`: ``LLM`` (a worker thread drives the core).

``llamabatch.LLM`` and ``llamabatch.LLMEngine`` are the public names.
"""
