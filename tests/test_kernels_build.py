"""The kernel build (`python -m moe_praxis.build_kernels`): runs where nvcc exists (it does in
CI), skipped with the reason elsewhere. The whole library is built ONCE per test session into
a temporary directory (session fixture) and shared by the tests that need it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_praxis import build_kernels
from moe_praxis.ops import backend

REPO = Path(__file__).resolve().parent.parent


def _nvcc_or_none():
    try:
        return build_kernels.find_nvcc()
    except build_kernels.BuildError:
        return None


@pytest.fixture(scope="session")
def built_library(tmp_path_factory):
    """(path, build log) of the whole library, built once per session."""
    nvcc = _nvcc_or_none()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): cannot build kernels")
    out = tmp_path_factory.mktemp("kernels") / build_kernels.LIB_NAME
    p = subprocess.run([sys.executable, "-m", "moe_praxis.build_kernels", "--output",
                        str(out)],
                       capture_output=True,
                       text=True,
                       cwd=REPO,
                       timeout=3600)
    assert p.returncode == 0, f"build failed:\n{p.stdout}\n{p.stderr}"
    return out, p.stdout


def test_build_exports_every_table_symbol(built_library):
    lib, log = built_library
    assert lib.is_file()
    have = build_kernels.exported_symbols(lib)
    missing = sorted(set(backend.KERNELS.values()) - have)
    assert not missing, f"{lib} lacks {missing}"
    # the build says what it built, where and how long it took
    assert f"built {lib}" in log and " s" in log.splitlines()[-1]
    for src in sorted((REPO / "kernels").glob("*.cu")):
        assert f"compiled kernels/{src.name}" in log


def test_built_library_has_hopper_and_ampere_code(built_library):
    lib, _ = built_library
    tool = Path(build_kernels.find_nvcc()).parent / "cuobjdump"
    if not tool.exists():
        tool = shutil.which("cuobjdump")
    if not tool:
        pytest.skip("cuobjdump not found (next to nvcc or on PATH): cannot list the targets")
    out = subprocess.run(
        [str(tool), "--list-elf", "--list-ptx", str(lib)], capture_output=True, text=True).stdout
    assert "sm_90a" in out, out[:2000]
    assert "sm_80" in out, out[:2000]
    assert ".ptx" in out or "compute_80" in out, out[:2000]


def test_loader_registers_the_built_library(built_library):
    lib, _ = built_library
    try:
        ok, why = backend.load_library(lib)
        assert ok, why
        assert str(lib) in why
    finally:
        backend.load_library(force=True)


def test_symbol_check_names_missing_symbols(built_library, monkeypatch):
    lib, _ = built_library
    assert build_kernels.KERNELS is backend.KERNELS  # the build checks the loader's one table
    table = dict(backend.KERNELS, moe_not_a_kernel="MoeNotAKernel")
    monkeypatch.setattr(build_kernels, "KERNELS", table)
    with pytest.raises(build_kernels.BuildError, match=r"does not export \['MoeNotAKernel'\]"):
        build_kernels.check_symbols(lib)


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build_kernels.os.path, "isfile", lambda p: False
                        if str(p).endswith("nvcc") else os.path.isfile(p))
    with pytest.raises(build_kernels.BuildError, match="nvcc not found"):
        build_kernels.find_nvcc()
    # the command line reports it as an error and exit status 1
    assert build_kernels.main(["--output", str(tmp_path / "x.so")]) == 1


def test_missing_ffi_header_is_a_clear_error(monkeypatch, tmp_path):
    import jax.ffi

    monkeypatch.setattr(jax.ffi, "include_dir", lambda: str(tmp_path))
    with pytest.raises(build_kernels.BuildError, match=r"xla/ffi/api/ffi.h not found under"):
        build_kernels.include_dirs()


def test_gencode_line_narrows_targets(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("// moe-praxis-gencode: sm_90a\n")
    assert build_kernels.gencodes_for(src) == [build_kernels.GENCODES["sm_90a"]]
    src.write_text("// plain\n")
    assert build_kernels.gencodes_for(src) == list(build_kernels.GENCODES.values())
    src.write_text("// moe-praxis-gencode: sm_70\n")
    with pytest.raises(build_kernels.BuildError, match="sm_70"):
        build_kernels.gencodes_for(src)


def test_unknown_only_source_is_rejected():
    with pytest.raises(build_kernels.BuildError, match="unknown sources"):
        build_kernels.sources(["nope.cu"])


def test_output_location_follows_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(build_kernels.ENV_LIB, raising=False)
    assert build_kernels.library_path() == build_kernels.DEFAULT_LIB
    monkeypatch.setenv(build_kernels.ENV_LIB, str(tmp_path / "lib.so"))
    assert build_kernels.library_path() == tmp_path / "lib.so"
