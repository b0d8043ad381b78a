"""Compile a C kernel of this package into a shared library once per machine, and load it.

The library is built for the CPU it runs on (``-march=native``) and cached under
``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), named by a hash of the
source, this package's headers (``*.h``, which sources include), the flags, the compiler's
version and the CPU's feature flags, so a changed kernel or another machine builds its own.
Processes that build at the same time (several workers on one host) each write a private file
and move it into place atomically.

The compiler is ``$CC`` or ``cc``. Without one, ``load`` raises ``KernelUnavailableError``
saying why, and callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).resolve().parent
# the C types of the kernels' arguments
INT64, POINTER, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
FLAGS = (
    "-O3",
    "-march=native",
    # let the compiler vectorise float reductions (dot products); NaN/inf semantics are kept
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
# Kernels share their rows out over OpenMP threads. At load time the library's libgomp is the
# one torch has loaded already (same soname), so they use torch's thread pool, not their own.
# A compiler without OpenMP builds them serial (the pragmas are ignored).
OPENMP_FLAG = "-fopenmp"


class KernelUnavailableError(RuntimeError):
    """A C kernel could not be built or loaded here (no compiler, a failed build)."""


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve" / "kernels"


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The library built from ``<name>.c`` in this package; built first if not cached."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise KernelUnavailableError(f"no C compiler to build the {name} kernel ({compiler!r})")
    source = SOURCE_DIR / f"{name}.c"
    library = cache_dir() / f"{name}-{_build_key(source, compiler)}.so"
    if not library.exists():
        _compile(compiler, source, library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise KernelUnavailableError(f"could not load {library}: {error}") from error


def function(library: str, symbol: str, restype: Any, argtypes: Sequence[Any]) -> Any:
    """``symbol`` of the library built from ``<library>.c``, typed for ctypes calls."""
    kernel = getattr(load(library), symbol)
    kernel.restype = restype
    kernel.argtypes = list(argtypes)
    return kernel


def _build_key(source: Path, compiler: str) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    for part in (" ".join([*FLAGS, OPENMP_FLAG]), _compiler_version(compiler), _cpu_features()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@functools.cache
def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return done.stdout


@functools.cache
def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile(compiler: str, source: Path, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        result = _run_compiler(compiler, [*FLAGS, OPENMP_FLAG], source, partial)
        if result.returncode != 0:
            serial = _run_compiler(compiler, FLAGS, source, partial)
            if serial.returncode != 0:
                raise KernelUnavailableError(
                    f"building {source.name} with {compiler} failed:\n{serial.stderr[-2000:]}"
                )
            logger.warning(
                "%s built without OpenMP (%s refused %s), so on one thread:\n%s",
                source.name,
                compiler,
                OPENMP_FLAG,
                result.stderr[-500:],
            )
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _run_compiler(
    compiler: str, flags: Sequence[str], source: Path, output: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [compiler, *flags, str(source), "-o", output, "-lm"],
        capture_output=True,
        text=True,
        check=False,
    )
