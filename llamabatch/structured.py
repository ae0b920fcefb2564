"""The public path named in the README: ``llamabatch.structured``.

The code lives in ``llamabatch/prompts/structured.py``; this name is the same module object."""

import sys

from llamabatch.prompts import structured as _module

sys.modules[__name__] = _module
