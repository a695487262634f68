"""Helpers of the grouped GEMM tests (test_grouped_gemm_*.py; also test_gate_up.py,
test_fp8_gpu.py, test_layer_bench.py): the float64 loop references written independently of the
op, the group-size patterns and random inputs, the shapes and tolerances the CUDA and sm_80 tests
share, the adaptive tile's cost model in Python, a faked GPU device for the CPU tests of the kernel
choice and the lowering for CUDA on such a host (cuda_module), and the script that runs the kernels inside CUDA graphs in a child process."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_praxis import ops
from moe_praxis.ops import backend
from tests.testutil import rel_err  # noqa: F401  (the command-buffer script reads t.rel_err)

# The module (the attribute ops.grouped_gemm is the function).
gg = importlib.import_module("moe_praxis.ops.grouped_gemm")

REPO = Path(__file__).resolve().parent.parent
# bf16 / fp16 outputs of the sm_80 kernels against the float64 loop on the same values
RTOL_16 = 1e-2


def loop_reference(lhs, rhs, group_sizes):
    """float64: out, and the maps used by the gradient references."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        out[start:start + size] = lhs[start:start + size] @ rhs[e]
        start += size
    return out


def loop_grads(lhs, rhs, group_sizes, dout):
    """float64 dlhs [M,K] and drhs [E,K,N] of sum(out * dout)."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    dout = np.asarray(dout, np.float64)
    dlhs = np.zeros_like(lhs)
    drhs = np.zeros_like(rhs)
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + size)
        dlhs[rows] = dout[rows] @ rhs[e].T
        drhs[e] = lhs[rows].T @ dout[rows]
        start += size
    return dlhs, drhs


def make_sizes(kind, m, e, rng):
    """Group sizes [E] of one kind; their sum is <= m."""
    if kind == "balanced":
        s = np.full(e, m // e)
        s[:m - s.sum()] += 1
    elif kind == "skewed":  # Zipf-like: a few experts take most rows
        w = 1.0 / np.arange(1, e + 1)**1.5
        w = rng.permutation(w)
        s = np.floor(w / w.sum() * m).astype(int)
        s[np.argmax(s)] += m - s.sum()
    elif kind == "one_takes_all":
        s = np.zeros(e, int)
        s[rng.integers(e)] = m
    elif kind == "empty_groups":  # every other expert empty, including the first and last
        s = np.zeros(e, int)
        idx = np.arange(1, e - 1, 2)
        s[idx] = m // len(idx)
        s[idx[0]] += m - s.sum()
    elif kind == "one_row":  # 1-row groups and a remainder
        s = np.ones(e, int)
        s[-1] = m - (e - 1)
    elif kind == "sum_lt_m":  # a third of the rows belong to no group
        s = np.full(e, (2 * m // 3) // e)
    elif kind == "random":
        cuts = np.sort(rng.integers(0, m + 1, e - 1))
        s = np.diff(np.concatenate([[0], cuts, [m]]))
    else:
        raise ValueError(kind)
    assert s.sum() <= m and (s >= 0).all()
    return s.astype(np.int32)


KINDS = ["balanced", "skewed", "one_takes_all", "empty_groups", "one_row", "sum_lt_m", "random"]


def _inputs(m, k, n, e, kind, dtype, seed):
    rng = np.random.default_rng(seed)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k2, (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dout = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
    gs = jnp.asarray(make_sizes(kind, m, e, rng))
    return lhs, rhs, gs, dout


# --------------------------------------------------------------- GPU (CUDA path)


def _cuda_or_skip():
    if not ops.backend.cuda_status("grouped_gemm")[0]:
        pytest.skip(f"CUDA grouped GEMM not usable: {ops.backend_info()['cuda']['reason']} / "
                    f"{ops.backend.cuda_status('grouped_gemm')[1]}")


GPU_SHAPES = [  # (M, K, N, E): M not a multiple of any tile, N and K not of 128
    (1000, 136, 200, 8),
    (777, 64, 136, 5),
]

# ------------------------------------------------ the adaptive tile's cost model

_PAIR_TYPES = {4: "AdaptiveWideThin", 7: "AdaptiveWideThin12", 10: "AdaptiveWideThin11"}
# The Hopper family's headers: grouped_gemm.cuh (launch, dispatch) includes the prepare step's,
# which includes the tile configurations'.
HOPPER_HEADERS = ("grouped_gemm.cuh", "grouped_gemm_prepare.cuh", "grouped_gemm_tiles.cuh")


def hopper_header_text():
    """The Hopper family's header text (HOPPER_HEADERS, concatenated)."""
    return "".join((REPO / "kernels" / name).read_text() for name in HOPPER_HEADERS)


def _adaptive_pct(tile, op):
    """The header's cost factor of the adaptive pair `tile` for op 'fwd' or 'dgrad'."""
    m = re.search(rf"using {_PAIR_TYPES[tile]} = Adaptive<[^;]*, (\d+), (\d+)>;",
                  hopper_header_text())
    assert m, f"kernels/grouped_gemm_tiles.cuh defines {_PAIR_TYPES[tile]}"
    return int(m.group(1) if op == "fwd" else m.group(2))


def adaptive_model(group_sizes, out_cols, sm_count, tile=4, op="fwd"):
    """The adaptive tile's cost model (kernels/grouped_gemm_prepare.cuh, moe_gg_prepare), in Python:
    1 if 64x256 ping-pong (2 tiles in flight per CTA, cost x the header's percentage) beats
    128x256 cooperative; each group's tile grid rounded up to whole clusters."""

    def up(x, q):  # x / q rounded up
        return -(-int(x) // q)

    cm, cn = gg.CLUSTERS[tile]
    cost = []
    for tm, tn, in_flight, pct in ((128, 256, 1, 100), (64, 256, 2, _adaptive_pct(tile, op))):
        tiles = sum(
            up(up(m, tm), cm) * cm * up(up(out_cols, tn), cn) * cn
            for m in np.maximum(group_sizes, 0))
        slots = sm_count * in_flight
        cost.append(-(-tiles // slots) * tm * tn * slots * pct)
    return int(cost[1] < cost[0])


# ----------------------------------------------------------- faked devices (CPU)


def _fake_device(monkeypatch, cc, name="NVIDIA A100-SXM4-80GB", smem=163 * 1024):
    """This process as a host whose driver sees one GPU of compute capability `cc`, JAX running
    on it and the kernel library loaded (device_query, jax_cuda_reason, library_status)."""
    dev = {
        "reason":
        "",
        "driver_version":
        13000,
        "runtime_version":
        13000,
        "devices": [{
            "name": name,
            "compute_capability": cc,
            "sm_count": 108,
            "shared_memory_per_block": smem,
        }]
    }
    monkeypatch.setattr(backend, "device_query", lambda: dev)
    monkeypatch.setattr(backend, "jax_cuda_reason", lambda: "")
    monkeypatch.setattr(backend, "library_status", lambda: (True, "loaded from a faked path"))
    monkeypatch.delenv(backend.ENV_GROUPED_GEMM, raising=False)
    monkeypatch.delenv(gg.ENV_TILE, raising=False)
    backend.reset_warnings()


def cuda_module(fn, *args) -> str:
    """The MLIR text of fn(*args) lowered for CUDA on this GPU-less host (jax.export; our FFI
    targets and ragged_all_to_all have no compatibility guarantee, so their checks are off)."""
    checks = [
        jax.export.DisabledSafetyCheck.custom_call(t)
        for t in list(backend.KERNELS) + ["ragged_all_to_all"]
    ]
    return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


# ------------------------------------------------- CUDA graphs (a child process)

_COMMAND_BUFFER_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, sys.argv[1])
from moe_praxis import ops
from moe_praxis.ops import backend
import moe_praxis as mp
from tests import grouped_gemm_util as t

out = {}
m, k, n, e = 1024, 128, 256, 8
def f(a, b, g, d):
    y, vjp = jax.vjp(lambda x, w: ops.grouped_gemm(x, w, g, backend="cuda"), a, b)
    return (y, *vjp(d))
fj = jax.jit(f)
errs = []
for i, kind in enumerate(t.KINDS):  # new group sizes every call, one executable
    seed = int(sys.argv[2]) + i
    lhs, rhs, gs, dout = t._inputs(m, k, n, e, kind, jnp.bfloat16, seed)
    y, dl, dr = fj(lhs, rhs, gs, dout)
    rl, rr = t.loop_grads(lhs, rhs, gs, dout)
    errs.append([float(t.rel_err(y, t.loop_reference(lhs, rhs, gs))), float(t.rel_err(dl, rl)),
                 float(t.rel_err(dr, rr))])
out["gg_errs"] = errs
out["gg_cache_size"] = fj._cache_size()
out["gg_stats"] = backend.call_stats()
out["gg_hlo_has_kernel"] = "moe_grouped_gemm_fwd" in fj.lower(lhs, rhs, gs, dout).as_text()

import dataclasses
cfg = mp.MoEConfig(num_experts=8, top_k=2, d_model=128, d_ff=256)
k1, k2 = jax.random.split(jax.random.key(int(sys.argv[2])))
params = mp.init_moe_params(k1, cfg)
x = jax.random.normal(k2, (4, 96, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
def run(backend):
    c = dataclasses.replace(cfg, kernel_backend=backend)
    def loss(p, xx):
        o = mp.moe_block(p, xx, c)
        return jnp.sum(o.y.astype(jnp.float32) * jnp.sin(xx.astype(jnp.float32))) + o.aux_loss
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
(lc, gc), (lx, gx) = run("cuda"), run("xla")
out["block_loss"] = [float(lc), float(lx)]
out["block_grad_errs"] = [float(t.rel_err(a, b)) for a, b in
                          zip(jax.tree.leaves(gc), jax.tree.leaves(gx))]
print("RESULT " + json.dumps(out))
"""


def check_in_command_buffers(script, seed, rtol, env=None):
    """Runs a command-buffer script (_COMMAND_BUFFER_SCRIPT or a variant) in a fresh process
    with command buffers forced on for custom calls (min graph size 1) and checks its result:
    the handlers ran captured into CUDA graphs through one executable, the grouped GEMM within
    `rtol` of the loop reference for every group-size pattern, the moe_block's loss and
    gradients within 2e-2 of the XLA path."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")
    proc = subprocess.run([sys.executable, "-c", script,
                           str(REPO), str(seed)],
                          capture_output=True,
                          text=True,
                          env=env,
                          cwd=REPO,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"seed={seed}\n{proc.stdout[-3000:]}\n"
                                            f"{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    # the handlers ran (fwd, dgrad, wgrad per call) and were captured into CUDA graphs
    assert res["gg_hlo_has_kernel"] and res["gg_stats"]["captured"] > 0, res
    assert res["gg_cache_size"] == 1, res
    for kind, errs in zip(KINDS, res["gg_errs"]):
        assert max(errs) < rtol, f"seed={seed} {kind}: {errs}"
    lc, lx = res["block_loss"]
    assert abs(lc - lx) <= 2e-2 * abs(lx), f"seed={seed} {res}"
    assert max(res["block_grad_errs"]) < 2e-2, f"seed={seed} {res}"
