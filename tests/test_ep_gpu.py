"""Expert parallelism on several GPUs: the whole layer on every mesh the GPUs allow equals the
same layer on one GPU.

For N visible GPUs (2, 4 or 8), every mesh of `gpu_meshes(N)` (ep over all of them, and ep
next to dp, fsdp and tp where N allows) runs `moe_block` forward and backward with the padded
and the ragged exchange and the default kernel backend ('auto': the CUDA kernels where built);
the reference is the same block without a mesh on GPU 0.

Tolerances, norm-wise relative:
- float32 inputs and parameters at 'highest' matmul precision: 1e-5 (only summation order
  differs: psums over shards, rows regrouped by source rank);
- bfloat16 inputs and parameters: 2e-2. bf16 keeps 8 bits of mantissa (eps 7.8e-3); each side
  rounds its bf16 intermediates (the expert activations, the per-shard partial sums of the
  gradients) at different points, which moves results by a few eps norm-wise.
Integer outputs (tokens_per_expert, dropped_tokens) must be equal in both dtypes: the
routing decisions are made from the same float32 logits.

Skipped with fewer than 2 GPUs (the CPU suite covers the padded exchange on 8 CPU devices in
tests/test_ep.py; XLA:CPU has no ragged all-to-all).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_praxis as mp
from tests.testutil import rel_err
from tests.testutil import seed as _seed

D_MODEL, D_FF, SEQ = 256, 512, 64
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def gpu_meshes(n: int) -> dict:
    """name -> (mesh shape, axis names, MeshResources kwargs) of the meshes n GPUs allow."""
    meshes = {
        f"ep{n}": ((n, ), ("ep", ), dict(ep="ep")),
        f"dp{n}": ((n, ), ("dp", ), dict(dp="dp")),
        f"fsdp{n}": ((n, ), ("fsdp", ), dict(fsdp="fsdp")),
    }
    if n >= 4:
        half = n // 2
        meshes[f"dp2xep{half}"] = ((2, half), ("dp", "ep"), dict(dp="dp", ep="ep"))
        meshes[f"fsdp2xep{half}"] = ((2, half), ("fsdp", "ep"), dict(fsdp="fsdp", ep="ep"))
        meshes[f"ep{half}xtp2"] = ((half, 2), ("ep", "tp"), dict(ep="ep", tp="tp"))
    if n >= 8:
        meshes["dp2xfsdp2xep2"] = ((2, 2, n // 4), ("dp", "fsdp", "ep"),
                                   dict(dp="dp", fsdp="fsdp", ep="ep"))
    return meshes


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _mesh_names():
    n = len(_gpus())
    return list(gpu_meshes(n)) if n >= 2 else ["needs-2-gpus"]


def _loss_and_grads(cfg, mesh=None, res=None):

    def loss(p, x, cot):
        o = mp.moe_block(p, x, cfg, mesh=mesh, resources=res)
        return jnp.sum((o.y * cot).astype(jnp.float32)) + o.aux_loss + o.z_loss, o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.parametrize("mesh_name", _mesh_names())
def test_gpu_mesh_equals_one_gpu(mesh_name, exchange, dtype):
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs >= 2 GPUs, found {len(gpus)}")
    shape, names, kw = gpu_meshes(len(gpus))[mesh_name]
    if "ep" not in kw and exchange == "ragged":
        pytest.skip("no ep axis: no token exchange (the padded case runs this mesh)")
    mesh = Mesh(np.array(gpus).reshape(shape), names)
    res = mp.MeshResources(**kw)
    seed = _seed()
    cfg = mp.MoEConfig(d_model=D_MODEL,
                       d_ff=D_FF,
                       num_experts=4 * len(gpus),
                       top_k=2,
                       z_loss_coeff=1e-3,
                       ep_exchange=exchange)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = jax.tree.map(lambda a: a.astype(dtype), mp.init_moe_params(k1, cfg))
    x = jax.random.normal(k2, (2 * len(gpus), SEQ, D_MODEL), jnp.float32).astype(dtype)
    cot = jax.random.normal(k3, x.shape, jnp.float32).astype(dtype)
    tol = TOL[dtype]
    msg = f"seed={seed} mesh={mesh_name} exchange={exchange} dtype={jnp.dtype(dtype).name}"
    with jax.default_matmul_precision("highest"):
        with jax.default_device(gpus[0]):
            (_, ref), (rp, rx) = _loss_and_grads(cfg)(params, x, cot)
        (_, got), (gp, gx) = _loss_and_grads(cfg, mesh, res)(params, x, cot)
    assert got.y.dtype == x.dtype, msg
    assert rel_err(got.y, ref.y) < tol, f"{msg} y: {rel_err(got.y, ref.y)}"
    for name in ("aux_loss", "z_loss"):
        a, b = float(getattr(got, name)), float(getattr(ref, name))
        assert abs(a - b) <= max(tol, 1e-5) * abs(b) + 1e-12, f"{msg} {name}: {a} vs {b}"
    np.testing.assert_array_equal(np.asarray(got.tokens_per_expert),
                                  np.asarray(ref.tokens_per_expert),
                                  err_msg=msg)
    assert int(got.dropped_tokens) == int(ref.dropped_tokens) == 0, msg
    assert rel_err(gx, rx) < tol, f"{msg} dx: {rel_err(gx, rx)}"
    for name in rp:
        assert rel_err(gp[name], rp[name]) < tol, f"{msg} d{name}: {rel_err(gp[name], rp[name])}"


def test_gpu_meshes_cover_each_role():
    """The mesh list the GPU test runs (checked here on the CPU, where it cannot run)."""
    for n in (2, 4, 8):
        meshes = gpu_meshes(n)
        for shape, names, kw in meshes.values():
            assert int(np.prod(shape)) == n, (n, shape)
            assert set(kw.values()) <= set(names), (names, kw)
        roles = {r for _, _, kw in meshes.values() for r in kw}
        assert {"ep", "dp", "fsdp"} <= roles, (n, roles)
        if n >= 4:
            assert "tp" in roles, (n, roles)
