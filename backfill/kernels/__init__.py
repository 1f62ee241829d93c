"""backfill's CPU kernels: a C++ extension built once by the set-up (`make install` runs
`python -m backfill.kernels`) with torch.utils.cpp_extension, and loaded on first use.

The extension holds linear layers that read GGUF-quantized weights as stored and the fused
decoder step. One binary serves every x86-64 CPU: each kernel has AVX-512 and AVX2 variants
(and a scalar reference) and picks one at run time (`isa()`). Where it cannot be built or
loaded (no compiler, another architecture, `BACKFILL_NO_KERNELS=1`), `extension()` returns
None and the engine runs its plain-PyTorch path.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

NAME = "backfill_cpu_kernels"
SOURCE_DIR = Path(__file__).parent / "csrc"
# Inside the package (ignored by git): an editable install finds it, and `make clean` removes it.
BUILD_DIR = Path(__file__).parent / "_build"
# NOTE: -fopenmp is what makes at::parallel_for (a header template) parallel inside the
# extension; without it every loop runs on the calling thread. torch ships its own libgomp.so.1,
# which the extension's libgomp dependency resolves to, so there is one OpenMP pool and
# torch.set_num_threads governs it.
CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _sources() -> list[str]:
    return sorted(str(p) for p in SOURCE_DIR.glob("*.cpp"))


def build(verbose: bool = False) -> ModuleType:
    """Compile (if any source or flag changed since the last build) and import the extension."""
    from torch.utils import cpp_extension

    # cpp_extension runs `ninja` from PATH: prefer the one installed beside this Python.
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=NAME,
        sources=_sources(),
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(BUILD_DIR),
        verbose=verbose,
    )


def extension() -> ModuleType | None:
    """The loaded extension, building it on first use if the set-up did not; None where it is
    disabled or cannot be built (logged once)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("BACKFILL_NO_KERNELS") == "1":
                _failed = True
                return None
            try:
                _module = build()
            except Exception as exc:  # noqa: BLE001 - any build failure means "run without"
                _failed = True
                logger.warning("CPU kernels unavailable (%s); running the plain-PyTorch path", exc)
    return _module


def available() -> bool:
    return extension() is not None


def zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on transparent huge pages where the
    extension and the OS have them (see csrc/hugepages.h; `BACKFILL_HUGEPAGES=0` turns them
    off): for the memory every step sweeps, the KV caches."""
    ext = extension()
    if ext is None:
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return ext.zeros_hugepages(nbytes).view(dtype).view(shape)
