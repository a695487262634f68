"""bf16x3 router GEMM (ops.split_dot, router_precision 'bf16x3' / 'auto'): float32-level logits
and gradients from bf16 GEMMs, against a float64 reference; 'auto' is bitwise 'float32' on the
CPU and bf16x3 when lowered for CUDA; the router precision benchmark's smoke run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import router_precision as rp
from moe_praxis.ops import router as router_op
from moe_praxis.ops.split_dot import bf16x3_dot
from tests.testutil import seed as _seed


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These are CPU tests (bitwise comparisons of CPU computations): on a GPU host too they run
    on the CPU device, where the compared programs are compiled alike."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_bf16x3_against_float64(x_dtype):
    """Forward and both gradients within 2e-5 relative of float64 (measured 2e-6 to 5e-6;
    one bf16 GEMM is near 2e-3); dx of a bf16 x is limited by its own bf16 rounding (4e-3)."""
    seed = _seed()
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (300, 512), x_dtype)  # 300: no tile multiple
    w = jax.random.normal(kw, (512, 48), jnp.float32) / 20
    g = jax.random.normal(kg, (300, 48), jnp.float32)
    y, vjp = jax.vjp(bf16x3_dot, x, w)
    dx, dw = vjp(g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    assert y.dtype == dw.dtype == jnp.float32 and dx.dtype == x_dtype
    assert _rel(y, x64 @ w64) < 2e-5, seed
    assert _rel(dw, x64.T @ g64) < 2e-5, seed
    assert _rel(dx, g64 @ w64.T) < (4e-3 if x_dtype == jnp.bfloat16 else 2e-5), seed
    # and it is not float32 in disguise: one bf16 GEMM's error is 100x larger
    lo = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert _rel(lo, x64 @ w64) > 30 * _rel(y, x64 @ w64), seed


def _loss(precision):

    def f(x, w):
        return jnp.sum(jnp.sin(router_op.router_gemm(x, w, precision=precision)))

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def test_auto_is_float32_on_the_cpu_bit_for_bit_and_bf16x3_for_cuda():
    seed = _seed()
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (64, 96), jnp.bfloat16)
    w = jax.random.normal(kw, (96, 16), jnp.float32)
    got, want = _loss("auto")(x, w), _loss("float32")(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"seed={seed}")
    cuda = _loss("auto").trace(x, w).lower(lowering_platforms=("cuda", )).as_text()
    cpu = _loss("auto").trace(x, w).lower(lowering_platforms=("cpu", )).as_text()
    # CUDA: fwd 2 bf16 GEMMs (x is bf16), dx 1 (its 3 terms stacked: a [64, 96] output from
    # [64, 16] and [16, 96]), dw 2; the split by reduce_precision
    assert cuda.count("stablehlo.dot_general") == 5 and "reduce_precision" in cuda
    assert "HIGHEST" not in cuda
    assert cpu.count("stablehlo.dot_general") == 3 and "HIGHEST" in cpu


def test_router_precision_benchmark_quick(tmp_path):
    out = tmp_path / "rp.json"
    assert rp.main(["--quick", "--shapes", "qwen3", "--no-block", "--json", str(out)]) == 0
    rows = {r["precision"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(rp.PRECISIONS)
    assert rows["float32"]["changed"] == 0 and rows["float32"]["logits_err"] < 1e-6
    assert rows["bf16x3"]["logits_err"] < 2e-5 < rows["bf16"]["logits_err"]


def test_large_outputs_are_one_gemm_over_the_stacked_contraction():
    """dx = g @ w^T ([T, M] from [T, E] and [E, M], float32 g and w) is one bf16 dot over 3E,
    equal within float32 rounding to the three separate bf16 GEMMs summed; the forward (a small
    [T, E] output) keeps separate GEMMs (stacking would copy x)."""
    seed = _seed()
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (300, 512), jnp.bfloat16)
    w = jax.random.normal(kw, (512, 48), jnp.float32) / 20
    g = jax.random.normal(kg, (300, 48), jnp.float32)
    _, vjp = jax.vjp(bf16x3_dot, x.astype(jnp.float32), w)
    bwd = str(jax.make_jaxpr(vjp)(g))
    # dx: one dot of K = 3 * 48; dw (a small [512, 48] output): three
    assert bwd.count("dot_general") == 4, bwd
    assert "bf16[300,144]" in bwd and "bf16[144,512]" in bwd, bwd
    assert str(jax.make_jaxpr(bf16x3_dot)(x, w)).count("dot_general") == 2
    dx = vjp(g)[0]
    hi = lambda a: a.astype(jnp.bfloat16)
    lo = lambda a: (a - hi(a).astype(jnp.float32)).astype(jnp.bfloat16)
    wt = w.T
    d = lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32)
    separate = (d(lo(g), hi(wt)) + d(hi(g), lo(wt))) + d(hi(g), hi(wt))
    assert _rel(dx, separate) < 1e-6, seed
