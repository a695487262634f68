"""Builds the CUDA FFI kernels: ``python -m moe_praxis.build_kernels``.

Conventions (every kernel author follows these; the loader and the tests rely on them):

1. Sources. Every ``kernels/*.cu`` file is compiled, and all of them are linked into ONE shared
   library, ``libmoe_praxis_kernels.so``. Common helpers live in ``kernels/*.h``
   (``kernels/moe_common.h``: the FFI include, the ``MOE_CUDA_CHECK`` / ``MOE_LAUNCH_CHECK``
   error-check helpers, ``MOE_INVALID`` argument errors, bf16/f32 conversions).
2. Targets. Each file is compiled for ``sm_90a`` (Hopper-only instructions: wgmma, TMA),
   ``sm_80`` machine code and ``compute_80`` PTX (so newer GPUs JIT it). Hopper-only code is
   guarded in the source (CUTLASS does this itself with ``CUTLASS_ARCH_MMA_SM90_SUPPORTED``).
   A file may narrow its targets with a line ``// moe-praxis-gencode: sm_90a`` (a
   comma-separated subset of ``sm_90a, sm_80, compute_80``) in its first 20 lines.
3. Headers. The XLA FFI headers come from the installed jaxlib (``jax.ffi.include_dir()``):
   build against the OLDEST supported jaxlib (0.10.2); the FFI ABI is forward compatible, so
   the library loads in newer jaxlibs. CUTLASS/CuTe headers come from the ``nvidia-cutlass``
   PyPI package (``pip install -e '.[cuda]'``, done by ``make install``) and are on the include
   path when that package is installed.
4. Location. The library is written to ``moe_praxis/lib/libmoe_praxis_kernels.so`` (next to this
   package), or to the path in the environment variable ``MOE_PRAXIS_KERNEL_LIB`` when it is
   set; the name, path and variable are the library layer's (``moe_praxis.ops._library``), which
   loads the library on first use. ``--output`` overrides both for one build.
5. Symbols. Every FFI handler is defined with ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` and listed in
   the ONE table ``moe_praxis.ops.backend.KERNELS`` (target name -> exported symbol). After
   linking, the build checks that every symbol in that table is exported by the library and
   fails, naming the missing ones, otherwise.

Object cache: each object file is kept in ``build/kernels/`` (git-ignored) under a hash of
its source, every ``kernels/*.h`` / ``*.cuh`` header, the flags, the targets and nvcc's
version, and reused when nothing changed (``--no-cache`` compiles everything).

Options: ``--output PATH``, ``--jobs N`` (parallel nvcc processes; default: CPU count),
``--nvcc PATH`` (default: ``$CUDA_HOME/bin/nvcc``, else the CUDA toolkit's nvcc as
``cuda.pathfinder`` finds it, ``nvcc`` on PATH or ``/usr/local/cuda/bin/nvcc``), ``--only a.cu,b.cu``
(compile a subset; skips the symbol check for symbols of other files; for development).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.ffi

from moe_praxis.ops._library import (  # noqa: F401  (the library layer's constants)
    DEFAULT_LIB, ENV_LIB, KERNELS, LIB_NAME, library_path)

try:
    from cuda import pathfinder as _pathfinder
except ImportError:  # cuda-python is the optional 'cuda' extra: the fallbacks below remain
    _pathfinder = None

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = REPO_ROOT / "kernels"
CACHE_DIR = REPO_ROOT / "build" / "kernels"

GENCODES = {
    "sm_90a": "arch=compute_90a,code=sm_90a",
    "sm_80": "arch=compute_80,code=sm_80",
    "compute_80": "arch=compute_80,code=compute_80",
}
_GENCODE_LINE = re.compile(r"//\s*moe-praxis-gencode:\s*([\w, ]+)")
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-Xcompiler=-fPIC", "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "-DNDEBUG", "-lineinfo", "-diag-suppress=940,2473", "--threads=0"
]


class BuildError(RuntimeError):
    """The build could not run or failed; the message says what to do."""


def _pathfinder_nvcc() -> str:
    """nvcc of the CUDA toolkit as cuda.pathfinder finds it ('' when it does not)."""
    if _pathfinder is None:
        return ""
    try:
        return _pathfinder.find_nvidia_binary_utility("nvcc") or ""
    except Exception:  # noqa: BLE001 - not found: the other candidates are tried
        return ""


def find_nvcc(nvcc: str | None = None) -> str:
    """Path of nvcc: the argument, $CUDA_HOME/bin/nvcc, the toolkit's as cuda.pathfinder finds
    it, nvcc on PATH or /usr/local/cuda/bin/nvcc; else BuildError."""
    candidates = [nvcc] if nvcc else []
    if os.environ.get("CUDA_HOME"):  # an explicit toolkit choice comes first
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append(_pathfinder_nvcc())
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found (looked at --nvcc, $CUDA_HOME/bin/nvcc, cuda.pathfinder, "
                     "PATH and /usr/local/cuda/bin/nvcc); install the CUDA toolkit (12.4+) or "
                     "pass --nvcc")


def include_dirs() -> list[str]:
    """FFI headers from jaxlib, kernels/ itself, and CUTLASS headers when nvidia-cutlass is
    installed. Raises BuildError when the FFI header is missing."""
    try:
        ffi_inc = jax.ffi.include_dir()
    except Exception as e:  # noqa: BLE001 - any failure means: no headers
        raise BuildError(f"cannot locate the XLA FFI headers via jax.ffi.include_dir(): {e}")
    if not os.path.isfile(os.path.join(ffi_inc, "xla", "ffi", "api", "ffi.h")):
        raise BuildError(f"XLA FFI header xla/ffi/api/ffi.h not found under {ffi_inc}; "
                         "install jaxlib >= 0.10.2")
    dirs = [ffi_inc, str(KERNEL_DIR)]
    dirs += cutlass_include_dirs()
    return dirs


def cutlass_include_dirs() -> list[str]:
    """CUTLASS and CuTe include dirs of the nvidia-cutlass package ([] if not installed)."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except Exception:  # noqa: BLE001
        spec = None
    if spec is None or not spec.origin:
        return []
    base = Path(spec.origin).parent / "source"
    dirs = [base / "include", base / "tools" / "util" / "include"]
    return [str(d) for d in dirs if d.is_dir()]


def sources(only: list[str] | None = None) -> list[Path]:
    """Every kernels/*.cu (sorted), or the named subset."""
    srcs = sorted(KERNEL_DIR.glob("*.cu"))
    if only:
        names = set(only)
        unknown = names - {s.name for s in srcs}
        if unknown:
            raise BuildError(f"--only names unknown sources {sorted(unknown)}; "
                             f"valid: {[s.name for s in srcs]}")
        srcs = [s for s in srcs if s.name in names]
    if not srcs:
        raise BuildError(f"no kernels/*.cu sources found in {KERNEL_DIR}")
    return srcs


def gencodes_for(src: Path) -> list[str]:
    """The -gencode values for one source (all of GENCODES unless the file narrows them)."""
    with open(src, encoding="utf-8") as fh:
        head = [next(fh, "") for _ in range(20)]
    for line in head:
        m = _GENCODE_LINE.search(line)
        if m:
            names = [n.strip() for n in m.group(1).split(",") if n.strip()]
            bad = [n for n in names if n not in GENCODES]
            if bad:
                raise BuildError(f"{src.name}: moe-praxis-gencode names {bad}; valid: "
                                 f"{sorted(GENCODES)}")
            return [GENCODES[n] for n in names]
    return list(GENCODES.values())


def exported_symbols(lib: Path) -> set[str]:
    """Dynamic symbols the library defines (via nm -D --defined-only)."""
    nm = shutil.which("nm")
    if nm is None:
        raise BuildError("nm (binutils) not found; cannot check the exported symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)],
                         capture_output=True,
                         text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def required_symbols() -> dict[str, str]:
    """The one table of FFI handlers: target name -> symbol (moe_praxis.ops.backend.KERNELS)."""
    return dict(KERNELS)


def check_symbols(lib: Path, only: list[str] | None = None) -> None:
    """Raises BuildError naming every table symbol the library does not export."""
    have = exported_symbols(lib)
    want = required_symbols()
    missing = sorted(sym for sym in want.values() if sym not in have)
    if missing and only:
        print(f"(--only build: not checking {len(missing)} symbols of other files)")
        return
    if missing:
        raise BuildError(f"{lib} does not export {missing} listed in "
                         "moe_praxis.ops.backend.KERNELS; define them with "
                         "XLA_FFI_DEFINE_HANDLER_SYMBOL in a kernels/*.cu file")


def _run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}"
                         f"{p.stdout}")
    return time.time() - t0, p.stderr


def _cache_key(nvcc: str, src: Path, cmd_tail: list[str]) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    h.update("\0".join(cmd_tail).encode())
    h.update(src.read_bytes())
    for hdr in sorted(list(KERNEL_DIR.glob("*.h")) + list(KERNEL_DIR.glob("*.cuh"))):
        h.update(hdr.name.encode() + hdr.read_bytes())
    return h.hexdigest()[:20]


def build(output: Path | None = None,
          *,
          jobs: int | None = None,
          nvcc: str | None = None,
          only: list[str] | None = None,
          verbose: bool = True,
          cache: bool = True) -> Path:
    """Compiles kernels/*.cu and links the library; returns its path. Raises BuildError."""
    t_start = time.time()
    nvcc = find_nvcc(nvcc)
    incs = include_dirs()
    srcs = sources(only)
    out = Path(output).resolve() if output else library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    log = print if verbose else (lambda *a, **k: None)
    log(f"nvcc: {nvcc}\nFFI/CUTLASS include dirs: {incs}")
    with tempfile.TemporaryDirectory(prefix="moe_praxis_build_") as tmp:

        def compile_one(src: Path):
            obj = Path(tmp) / (src.stem + ".o")
            tail = [*NVCC_FLAGS]
            for g in gencodes_for(src):
                tail += ["-gencode", g]
            tail += [f"-I{d}" for d in incs]
            cached = CACHE_DIR / f"{src.stem}-{_cache_key(nvcc, src, tail)}.o"
            if cache and cached.is_file():
                shutil.copyfile(cached, obj)
                return src, obj, None
            secs, _ = _run([nvcc, "-c", str(src), "-o", str(obj), *tail])
            if cache:
                CACHE_DIR.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(obj, str(cached) + ".tmp")
                os.replace(str(cached) + ".tmp", cached)
            return src, obj, secs

        objs = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for src, obj, secs in pool.map(compile_one, srcs):
                if secs is None:
                    log(f"  compiled {src.relative_to(REPO_ROOT)}: unchanged, cached object")
                else:
                    log(f"  compiled {src.relative_to(REPO_ROOT)} in {secs:.1f} s")
                objs.append(obj)
        tmp_lib = Path(tmp) / LIB_NAME
        secs, _ = _run([nvcc, "-shared", "-o", str(tmp_lib), *map(str, objs)])
        check_symbols(tmp_lib, only)
        # Copy next to the target, then rename: a process that has the old library mapped keeps
        # a valid mapping (overwriting it in place can crash that process).
        staged = out.with_name(out.name + f".{os.getpid()}.tmp")
        shutil.copyfile(tmp_lib, staged)
        os.replace(staged, out)
    log(f"built {out} ({out.stat().st_size / 1e6:.1f} MB) from {len(srcs)} sources "
        f"for {', '.join(GENCODES)} in {time.time() - t_start:.1f} s")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_praxis.build_kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--output",
                    default=None,
                    help=f"library path (default: ${ENV_LIB} or {DEFAULT_LIB})")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes")
    ap.add_argument("--nvcc", default=None, help="path of nvcc")
    ap.add_argument("--only", default=None, help="comma-separated kernels/*.cu subset")
    ap.add_argument("--no-cache",
                    action="store_true",
                    help=f"compile every source (ignore the object cache in {CACHE_DIR})")
    args = ap.parse_args(argv)
    try:
        build(args.output,
              jobs=args.jobs,
              nvcc=args.nvcc,
              only=args.only.split(",") if args.only else None,
              cache=not args.no_cache)
    except BuildError as e:
        print(f"build_kernels: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
