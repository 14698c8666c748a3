"""Builds and loads the C kernels (every ``.c`` file here and under ``arch/``) for this CPU, and declares their
signatures.

NOTE: the library is built with ``-march=native`` and cached under ``~/.cache/harpoon/cpu_kernels`` keyed by the
source, the compiler and the CPU's flags, so a copied cache never runs on a CPU it was not built for. Where no C
compiler exists (slim containers) or ``HARPOON_CPU_KERNELS=0``, ``available()`` is False and callers keep their
plain-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parent
# NOTE: -mtune=haswell schedules the AVX2 micro-kernel ~5-8% faster than the znver1 tuning -march=native picks on the
# AMD EPYC development machines.
FLAGS = ["-O3", "-march=native", *(["-mtune=haswell"] if platform.machine() == "x86_64" else []), "-fopenmp",
         "-fPIC", "-std=gnu11"]
c_float, c_int, c_i64, ptr = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
log = logging.getLogger(__name__)


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor()


def sources(root: Path = ROOT) -> list[Path]:
    """The library's C files: every ``.c`` under ``root`` (``arch/`` included), one object each."""
    return sorted(root.rglob("*.c"))


def headers(root: Path = ROOT) -> list[Path]:
    return sorted(root.rglob("*.h"))


def compile_library(compiler: str, root: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile every C file under ``root`` to an object, the files side by side on the cores, and link them into the
    shared library ``out``. CalledProcessError (with the compiler's messages) where one fails."""
    objects = [out.parent / (f"{out.stem}-" + "-".join(f.relative_to(root).with_suffix(".o").parts))
               for f in sources(root)]

    def compile_one(source: Path, obj: Path) -> None:
        subprocess.run([compiler, *FLAGS, *extra_flags, "-c", str(source), "-o", str(obj)], check=True,
                       capture_output=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, sources(root), objects))  # list(): raise the first failure here
    subprocess.run([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(out), "-lm"], check=True,
                   capture_output=True)


def build(compiler: str) -> Path:
    """The library for this CPU, compiled once and then taken from the cache (keyed by every C file's path and text,
    the compiler's version, the CPU and the flags)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [f"{f.relative_to(ROOT)}\n{f.read_text()}" for f in (*sources(), *headers())]
    key = hashlib.sha256(b"\0".join(s.encode() for s in (*texts, version, _cpu_id(), *FLAGS)))
    cache_dir = Path(os.environ.get("HARPOON_CACHE", Path.home() / ".cache" / "harpoon")) / "cpu_kernels"
    target = cache_dir / f"ops-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = Path(tmp) / "ops.so"
        compile_library(compiler, ROOT, built)
        os.replace(built, target)  # atomic: concurrent builders both end with a whole file
    return target


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# argument types of the kernels the library exports (ops.h); each returns nothing unless _RESULTS says otherwise
_SIGNATURES = {
    "hp_pack_weight": [ptr, ptr, c_int, c_int],
    "hp_pack_words": [ptr, ptr, c_int, c_int, c_int],
    "hp_q8x_available": [],
    "hp_q8x_dots": [],
    "hp_q8x_tiles_available": [],
    "hp_shm_sum": [ptr, c_int, c_int, c_i64, ptr, c_i64, c_i64, ctypes.c_double],
    "hp_shm_sum_bytes": [c_int, c_i64],
    "hp_linear": [ptr, c_i64, ptr, ptr, ptr, c_i64, c_int, c_int, c_int],
    "hp_linear_i8": [ptr, c_i64, ptr, ptr, ptr, c_i64, c_int, c_int, c_int],
    "hp_q8x_rounding_error": [ptr, c_i64, c_int, c_int, ptr],
    "hp_linear_packed": [c_int, ptr, c_i64, ptr, ptr, ptr, c_i64, c_int, c_int, c_int],
    "hp_argmax_packed": [c_int, ptr, c_i64, ptr, c_int, c_int, c_int, ptr],
    "hp_screened_argmax": [ptr, c_i64, c_int, c_int, ptr, ptr, ptr, c_int, ptr, c_int, c_int, ptr],
    "hp_paged_decode_attention": [ptr, c_i64, ptr, ptr, ptr, c_i64, ptr, ptr, c_i64, c_int, c_int,
                                  c_int, c_int, c_int, c_float, c_int],
    "hp_rms_norm": [ptr, c_i64, ptr, ptr, c_int, c_int, c_float],
    "hp_add_rms_norm": [ptr, ptr, ptr, ptr, c_int, c_int, c_float],
    "hp_rotary": [ptr, c_i64, ptr, ptr, ptr, c_int, c_int, c_int],
    "hp_silu_mul": [ptr, ptr, c_int, c_int],
    "hp_store_kv": [ptr, c_i64, ptr, c_i64, ptr, ptr, ptr, c_int, c_int, c_int, c_int],
    "hp_embed_rows": [c_int, ptr, c_int, c_int, ptr, c_int, ptr],
    "hp_row_norms": [c_int, ptr, c_int, c_int, ptr],
    "hp_widen_panels": [c_int, ptr, c_int, c_int, ptr],
    "hp_find_blocks": [c_int, ptr, c_i64, ptr, ptr, ptr],
    "hp_pack_gguf": [c_int, ptr, c_int, c_int, c_int, ptr],
    "hp_pack_gguf_widened": [c_int, ptr, c_int, c_int, ptr],
    "hp_pack_gguf_ksplit": [c_int, ptr, c_int, c_int, ptr],
    "hp_apply_token_bitmask": [ptr, c_i64, ptr, ptr, c_int, c_int, c_int],
    "hp_bf16_dots": [],
    "hp_f32_bodies": [],
}
_RESULTS = {"hp_argmax_packed": c_int, "hp_q8x_available": c_int, "hp_q8x_dots": c_int,
            "hp_q8x_tiles_available": c_int, "hp_embed_rows": c_int, "hp_row_norms": c_int, "hp_widen_panels": c_int,
            "hp_find_blocks": c_int, "hp_bf16_dots": c_int, "hp_f32_bodies": c_int, "hp_shm_sum": c_int,
            "hp_shm_sum_bytes": c_i64, "hp_pack_gguf": c_i64, "hp_pack_gguf_widened": c_i64,
            "hp_pack_gguf_ksplit": c_i64}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the signatures of the kernels a build exports (an older revision's build may lack some)."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, _RESULTS.get(name)
    return lib


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("HARPOON_CPU_KERNELS", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: CPU kernels disabled, using the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("building the CPU kernels failed, using the slower torch path: %s %s", e, detail.decode()[-500:])
        return None
    return declare(lib)


def available() -> bool:
    return library() is not None


