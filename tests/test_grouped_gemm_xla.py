"""ops.grouped_gemm on every platform (the XLA path): ragged_dot semantics, its custom_vjp, the
checks of its inputs, and the error of a 'cuda' backend without usable kernels.

References are written independently of the op: a float64 NumPy loop over groups
(tests/grouped_gemm_util.py). Tolerance (norm-wise relative error ||out - ref|| / ||ref||):
float32 inputs on the CPU (XLA path): 1e-5 -- float32 products, only summation order and float32
rounding differ from the float64 loop (~1e-7).
Inputs are fresh random draws every run (the seed is printed on failure).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_praxis import ops
from tests.grouped_gemm_util import KINDS, _inputs, loop_grads, loop_reference
from tests.testutil import rel_err
from tests.testutil import seed as _seed

RTOL_F32 = 1e-5


@pytest.fixture
def f32_products():
    """Full float32 products (XLA:GPU's default for float32 dots is TF32, ~3e-4)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.usefixtures("f32_products")
@pytest.mark.parametrize("kind", KINDS)
def test_xla_forward_and_grads_match_loop(kind):
    seed = _seed()
    m, k, n, e = 37, 16, 24, 6
    lhs, rhs, gs, dout = _inputs(m, k, n, e, kind, jnp.float32, seed)
    msg = f"seed={seed} kind={kind} sizes={np.asarray(gs)}"
    out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm(a, b, gs, backend="xla"), lhs, rhs)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, loop_reference(lhs, rhs, gs)) < RTOL_F32, msg
    total = int(np.asarray(gs).sum())
    np.testing.assert_array_equal(np.asarray(out[total:]), 0.0, err_msg=msg)
    dlhs, drhs = vjp(dout)
    ref_dlhs, ref_drhs = loop_grads(lhs, rhs, gs, dout)
    assert rel_err(dlhs, ref_dlhs) < RTOL_F32, msg
    assert rel_err(drhs, ref_drhs) < RTOL_F32, msg
    empty = np.asarray(gs) == 0
    np.testing.assert_array_equal(np.asarray(drhs)[empty], 0.0, err_msg=msg)
    np.testing.assert_array_equal(np.asarray(dlhs[total:]), 0.0, err_msg=msg)


@pytest.mark.usefixtures("f32_products")
def test_custom_vjp_matches_jax_grad_of_ragged_dot():
    seed = _seed()
    lhs, rhs, gs, dout = _inputs(29, 8, 16, 5, "skewed", jnp.float32, seed)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b) * dout)

    ours = jax.grad(lambda a, b: loss(lambda x, w: ops.grouped_gemm(x, w, gs, backend="xla"), a, b),
                    argnums=(0, 1))(lhs, rhs)
    ref = jax.grad(lambda a, b: loss(
        lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST), a, b),
                   argnums=(0, 1))(lhs, rhs)
    for got, want, name in zip(ours, ref, ("dlhs", "drhs")):
        assert rel_err(got, want) < RTOL_F32, f"{name} seed={seed}"


@pytest.mark.usefixtures("f32_products")
def test_grad_under_jit_and_group_sizes_not_differentiated():
    seed = _seed()
    lhs, rhs, gs, dout = _inputs(20, 8, 8, 4, "random", jnp.float32, seed)
    f = jax.jit(
        jax.grad(lambda a, b, g: jnp.sum(ops.grouped_gemm(a, b, g, backend="xla") * dout),
                 argnums=(0, 1)))
    dlhs, drhs = f(lhs, rhs, gs)
    ref_dlhs, ref_drhs = loop_grads(lhs, rhs, gs, dout)
    assert rel_err(dlhs, ref_dlhs) < RTOL_F32 and rel_err(drhs, ref_drhs) < RTOL_F32


def test_bad_inputs_raise_clear_errors():
    lhs = jnp.ones((8, 4))
    rhs = jnp.ones((2, 4, 8))
    with pytest.raises(ValueError, match=r"lhs \[M,K\], rhs \[E,K,N\]"):
        ops.grouped_gemm(lhs, jnp.ones((2, 5, 8)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match=r"group_sizes must be \[E=2\]"):
        ops.grouped_gemm(lhs, rhs, jnp.array([8]))
    with pytest.raises(ValueError, match="must be integers"):
        ops.grouped_gemm(lhs, rhs, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="config 'nope' is invalid"):
        ops.grouped_gemm(lhs, rhs, jnp.array([4, 4]), config="nope")
    with pytest.raises(ValueError, match="config 'coop_256x128_c2x1/along_k' is invalid"):
        ops.grouped_gemm(lhs, rhs, jnp.array([4, 4]), config="coop_256x128_c2x1/along_k")
    with pytest.raises(ValueError, match="kernel_backend='gpu' is invalid"):
        ops.grouped_gemm(lhs, rhs, jnp.array([4, 4]), backend="gpu")


def test_cuda_backend_without_usable_kernels_says_why():
    if ops.backend.cuda_status()[0]:
        pytest.skip("a GPU and the kernel library are usable here (a resolved 'cuda' falls back "
                    "where only the grouped GEMM's compute capability is unmet)")
    with pytest.raises(RuntimeError, match="kernel_backend='cuda' requested for grouped_gemm"):
        ops.grouped_gemm(jnp.ones((8, 8), jnp.bfloat16),
                         jnp.ones((2, 8, 8), jnp.bfloat16),
                         jnp.array([4, 4]),
                         backend="cuda")
