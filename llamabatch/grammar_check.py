"""The public path named in the README: ``llamabatch.grammar_check``.

The code lives in ``llamabatch/prompts/grammar_check.py``; this name is the same module object."""

import sys

from llamabatch.prompts import grammar_check as _module

sys.modules[__name__] = _module
