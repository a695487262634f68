"""kernels/grouped_gemm_gather_pingpong.cuh is CUTLASS's ping-pong pointer-array kernel with three
marked changes: the installed CUTLASS header with exactly those changes gives the file back, so a
CUTLASS upgrade that changes the kernel fails here instead of running a stale copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_praxis import build_kernels

ROOT = Path(__file__).resolve().parents[1]
COPY = ROOT / "kernels" / "grouped_gemm_gather_pingpong.cuh"
UPSTREAM = "cutlass/gemm/kernel/sm90_gemm_array_tma_warpspecialized_pingpong.hpp"


def _installed_header() -> str:
    for d in build_kernels.cutlass_include_dirs():
        p = Path(d) / UPSTREAM
        if p.is_file():
            return p.read_text()
    pytest.skip("nvidia-cutlass is not installed")


def _marked_changes(text: str) -> str:
    """The header with the copy's changes: the note, the schedule tag and changes 1-3."""
    copy = COPY.read_text()
    note = copy[copy.index("// moe_praxis: CUTLASS's ping-pong"):copy.index("#pragma once")]
    tag = copy[copy.index("\nnamespace moe_gg {"):copy.index("}  // namespace moe_gg\n") + 23]
    edits = [
        ("#pragma once", note + "#pragma once"),
        ('#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"\n',
         '#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"\n' + tag),
        ("  cute::enable_if_t<cute::is_base_of_v<KernelPtrArrayTmaWarpSpecializedPingpong, "
         "typename CollectiveMainloop_::DispatchPolicy::Schedule>>",
         "  // moe_praxis: change 1\n  cute::enable_if_t<cute::is_same_v<moe_gg::KernelGatherPingpong,"
         " typename CollectiveMainloop_::DispatchPolicy::Schedule>>"),
        ("  static_assert(cute::is_base_of_v<KernelPtrArrayTmaWarpSpecializedPingpong, typename "
         "CollectiveMainloop_::DispatchPolicy::Schedule>);",
         "  static_assert(cute::is_same_v<moe_gg::KernelGatherPingpong, typename "
         "CollectiveMainloop_::DispatchPolicy::Schedule>);  // moe_praxis: change 1"),
        ("    CollectiveEpilogue collective_epilogue(params.epilogue, "
         "shared_storage.tensors.epilogue);\n",
         "    CollectiveEpilogue collective_epilogue(params.epilogue, "
         "shared_storage.tensors.epilogue);\n"
         "    // moe_praxis: change 2 (no warp is left to load C for the epilogue)\n"
         "    if (collective_epilogue.is_producer_load_needed()) {\n      __trap();\n    }\n"),
        ("    auto producer_warp_role = ProducerWarpRole(warp_idx_in_warp_group);",
         "    // moe_praxis: change 2 (warp 2 copies A as a second MainloopAux warp)\n"
         "    static_assert(IsMainloopAuxiliaryLoadNeeded, \"the gathered mainloop copies A in "
         "MainloopAux\");\n    auto producer_warp_role = ProducerWarpRole(\n"
         "        warp_idx_in_warp_group == int(ProducerWarpRole::Epilogue) ? "
         "int(ProducerWarpRole::MainloopAux)\n"
         "                                                                 : "
         "warp_idx_in_warp_group);"),
        ("+ (collective_epilogue.is_producer_load_needed() ? 1 : 0)   // Epilog DMA warp",
         "+ 1   // moe_praxis: change 3 (warp 2 as MainloopAux)"),
    ]
    for old, new in edits:
        assert text.count(old) == 1, f"the installed CUTLASS kernel changed: {old[:60]!r}"
        text = text.replace(old, new)
    return text


def test_gather_pingpong_kernel_is_cutlass_with_its_marked_changes():
    expected = _marked_changes(_installed_header())
    actual = COPY.read_text()
    assert actual == expected, ("kernels/grouped_gemm_gather_pingpong.cuh differs from the "
                                "installed CUTLASS kernel beyond its marked changes")
    assert actual.count("moe_praxis: change") == 5
