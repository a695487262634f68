"""FP8 expert weights made once (moe_praxis.quantize_expert_weights, ops.fp8.weights) on the CPU.

Every comparison here is bitwise: the FP8 form made beforehand runs the same quantizer on the
same values as the quantization inside each GEMM, so outputs, loss and every gradient must be
identical, not close. Each test also checks that something nonzero was compared.
"""

import warnings

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis.ops.fp8 import recipe as fp8, weights as fp8_weights
from tests.testutil import seed as _seed

FP8_WEIGHTS = "fp8_weights"


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These are CPU tests (bitwise comparisons of CPU computations): on a GPU host too they run
    on the CPU device, where the compared programs are compiled alike."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _assert_same(a_tree, b_tree, what):
    la, lb = jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)
    assert len(la) == len(lb) > 0, what
    for a, b in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(a, np.float32),
                                      np.asarray(b, np.float32),
                                      err_msg=what)


@pytest.mark.parametrize("path", ["xla", "cuda"])
def test_op_prequantized_bitwise_equals_quantize_per_call(path):
    """One grouped GEMM (skewed groups, one empty): output, dlhs and dw bitwise; the FP8 form
    gets no gradient. 'cuda' lowers each kernel to its reference on the CPU."""
    seed = _seed()
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    sizes = jnp.array([0, 200, 1, 99], jnp.int32)
    x = jax.random.normal(k1, (300, 256), jnp.bfloat16)
    w = jax.random.normal(k2, (4, 256, 384), jnp.float32)
    cot = jax.random.normal(k3, (300, 384), jnp.bfloat16)
    fw = fp8_weights.quantize(w, transposed=path == "cuda")

    def run(f):
        y, vjp = jax.vjp(f, x, w)
        return y, vjp(cot)

    per_call = run(lambda a, b: fp8.fp8_grouped_gemm_path(a, b, sizes, path))
    once = run(lambda a, b: fp8_weights.prequantized_path(a, b, fw, sizes, path))
    _assert_same(once, per_call, f"seed={seed} path={path}")
    assert float(jnp.max(jnp.abs(once[1][1]))) > 0
    # W and W^T share their scales: qt is the transpose of q, value for value
    if path == "cuda":
        np.testing.assert_array_equal(np.asarray(fw.qt, np.float32),
                                      np.asarray(jnp.swapaxes(fw.q, 1, 2), np.float32))


def _block_setup(seed, gated=True, m=256, dtype=jnp.bfloat16, num_experts=4, fp8_gemms="all"):
    cfg = mp.MoEConfig(d_model=m,
                       d_ff=384,
                       num_experts=num_experts,
                       top_k=2,
                       gated=gated,
                       kernel_backend="xla",
                       fp8="blockwise",
                       fp8_gemms=fp8_gemms)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(lambda a: a.astype(dtype), mp.init_moe_params(k1, cfg))
    x = jax.random.normal(k2, (8, 20, m), dtype)
    cot = jax.random.normal(k3, x.shape, dtype)
    return cfg, params, x, cot


def _step(cfg, cot, once, **mesh):
    """value_and_grad of a loss over (params, x); once: the FP8 form made outside the loss
    (as a train step makes it before its micro-batches) and passed in with the params."""

    def loss(p, fws, x):
        q = p if fws is None else {**p, FP8_WEIGHTS: fws}
        o = mp.moe_block(q, x, cfg, **mesh)
        return jnp.sum((o.y * cot).astype(jnp.float32)) + o.aux_loss, o.y

    grad = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)

    def step(p, x):
        fws = mp.quantize_expert_weights(p, cfg)[FP8_WEIGHTS] if once else None
        return grad(p, fws, x)

    return jax.jit(step)


@pytest.mark.parametrize("fp8_gemms", ["all", "fwd", "wo=fwd", "wi=fwd"])
@pytest.mark.parametrize("kernels", [False, True], ids=["emulation", "kernel_path"])
def test_moe_block_quantize_once_bitwise_equals_quantize_per_call(monkeypatch, kernels, fp8_gemms):
    """The whole block, loss, y, dx and every parameter gradient bitwise, on the emulation and
    on the FP8 kernels' FFN forced on the CPU (each kernel lowered to its reference; there the
    forward reads qt). Float32 master weights: their gradients come back in float32. Every GEMM
    in FP8, and the mixed forms the FP8 quality runs train with (the forwards only, one
    weight's forward only): a train step makes the form once (moe_praxis.step_fp8_weights), so
    it must be what each layer would make itself."""
    seed = _seed()
    cfg, params, x, cot = _block_setup(seed, dtype=jnp.float32, fp8_gemms=fp8_gemms)
    if kernels:
        monkeypatch.setattr(fp8, "resolve", lambda backend: "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulation's notice
        per_call = _step(cfg, cot, False)(params, x)
        once = _step(cfg, cot, True)(params, x)
    _assert_same(once, per_call, f"seed={seed}")
    grads = once[1][0]
    assert set(grads) == set(params) and grads["wo"].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(grads["wi_gate"]))) > 0
    fws = mp.quantize_expert_weights(params, cfg)[FP8_WEIGHTS]
    assert (fws["wo"].qt is not None) == kernels


@pytest.mark.parametrize("fp8_gemms,quantized", [("all", 2), ("fwd", 2), ("wo=fwd", 1),
                                                 ("wi_up=fwd", 1)])
def test_moe_block_with_fp8_weights_quantizes_no_weight(monkeypatch, fp8_gemms, quantized):
    """Traced with the FP8 form given, moe_block calls no weight quantizer; without it, one per
    expert weight in FP8 and call (so calling it once per micro-batch would quantize n times)."""
    cfg, params, x, _ = _block_setup(_seed(), gated=False, fp8_gemms=fp8_gemms)
    calls = []
    for name in ("quantize_blocks", "quantize_weight"):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    given = mp.quantize_expert_weights(params, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        jax.eval_shape(lambda p, x: mp.moe_block(p, x, cfg).y, given, x)
        assert calls == []
        jax.eval_shape(lambda p, x: mp.moe_block(p, x, cfg).y, params, x)
    assert len(calls) == quantized, calls  # of wi_up and wo, those with a GEMM in FP8


def test_fsdp_ep_fp8_weights_gathered_in_fp8_and_bitwise():
    """fsdp4 x ep2: the FP8 form made from the globally sharded weights outside moe_block gives
    bitwise the step of quantizing inside (before the gather), and the lowered step's weight
    all-gathers carry e4m3 and no bf16 weight. fsdp on d_model (the 128x128 blocks of a shard
    along K or N; the expert dim is the simpler case)."""
    fsdp_dim = "model"
    seed = _seed()
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("fsdp", "ep"))
    res = mp.MeshResources(fsdp="fsdp", ep="ep", fsdp_dim=fsdp_dim)
    m = 512 if fsdp_dim == "model" else 128
    cfg, params, x, cot = _block_setup(seed, m=m, num_experts=8)
    per_call = _step(cfg, cot, False, mesh=mesh, resources=res)
    once = _step(cfg, cot, True, mesh=mesh, resources=res)
    _assert_same(once(params, x), per_call(params, x), f"seed={seed}")
    gathers = [l for l in once.lower(params, x).as_text().splitlines() if "all_gather" in l]
    assert any("f8E4M3FN" in l for l in gathers), gathers
    assert not any("bf16" in l for l in gathers), gathers


def test_fp8_weights_errors_name_the_value():
    cfg, params, x, _ = _block_setup(0, gated=False)
    given = mp.quantize_expert_weights(params, cfg)
    bad = {**given, FP8_WEIGHTS: {**given[FP8_WEIGHTS], "wo": given[FP8_WEIGHTS]["wi_up"]}}
    with pytest.raises(ValueError, match=r"FP8 weight of wo: q is float8_e4m3fn\[4, 256, 384\]"):
        mp.moe_block(bad, x, cfg)
    plain = mp.MoEConfig(d_model=256, d_ff=384, num_experts=4, gated=False, kernel_backend="xla")
    with pytest.raises(ValueError, match="'fp8_weights'.*fp8=None"):
        mp.moe_block(given, x, plain)
    with pytest.raises(ValueError, match="quantize_expert_weights needs MoEConfig.fp8"):
        mp.quantize_expert_weights(params, plain)
