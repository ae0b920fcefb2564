"""Type stub for the compiled cffi module ``llamabatch._ffi._llama`` (built from _cdefs.h).

``lib`` exposes the functions, enum values and callbacks declared in ``_cdefs.h`` and ``ffi``
is cffi's ``FFI`` instance; both are dynamic (their attributes come from the cdef), so they
are typed ``Any``. Only ``llamabatch._ffi`` uses them.
"""

from typing import Any

ffi: Any
lib: Any
