# The types of ``llamabatch._vendor``: setup.py installs ``vendor/`` under that name
# (``package_dir``), a mapping mypy cannot follow from the source tree. Keep in step with
# ``vendor/__init__.py``.
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_DIST: str
LLAMA_CPP_PYTHON_VERSION: str
LLAMA_CPP_COMMIT: str
PREFIX_ENV: str

class LlamaBuildNotFound(ImportError): ...

@dataclass(frozen=True)
class LlamaBuild:
    include_dir: Path
    lib_dir: Path
    origin: str
    @property
    def header(self) -> Path: ...
    def library(self, stem: str) -> Path | None: ...

def find_build() -> LlamaBuild: ...
def preload(build: LlamaBuild | None = None) -> LlamaBuild: ...
def missing_symbols(names: list[str], build: LlamaBuild | None = None) -> list[str]: ...
