"""Prompt handling, before the engine sees a request: prompts as token ids (``inputs``), chat
templates (``chat_template``), JSON schemas and ``response_format`` as grammars
(``structured``), and GBNF grammars checked before llama.cpp parses them (``grammar_check``)."""
