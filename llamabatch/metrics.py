"""The public path named in the README: ``llamabatch.metrics``.

The code lives in ``llamabatch/runtime/metrics.py``; this name is the same module object."""

import sys

from llamabatch.runtime import metrics as _module

sys.modules[__name__] = _module
