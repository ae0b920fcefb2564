"""The public path of the test models named in the README: ``llamabatch.testing``.

The code lives in ``llamabatch/gguf/testing.py``; this name is the same module object."""

import sys

from llamabatch.gguf import testing as _testing

sys.modules[__name__] = _testing
