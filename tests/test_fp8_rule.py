"""The per-GEMM FP8 rule (MoEConfig.fp8_gemms, ops.fp8.rule) and its mixed GEMM on the CPU.

A GEMM the rule leaves in bf16 must be the bf16 grouped GEMM of the master weight and one it
keeps in FP8 the FP8 recipe's (ops.fp8): the mixed op is compared, output and both gradients,
with the pieces of the two reference ops (the FP8 emulation / its kernel path lowered to
references, and ops.grouped_gemm's XLA path), on skewed groups with an empty one and rows past
their sum. Both compute the same operations, so the bound is float32 rounding (1e-6
norm-wise), and each compared FP8 piece differs from its bf16 twin by more than 1e-3 (the
choice is really applied). The block on an fsdp x ep mesh under 'auto' equals one device.
"""

import re
import warnings

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import moe_praxis as mp
from moe_praxis import ops
from moe_praxis.ops.fp8 import recipe as fp8, rule as fp8_rule, weights as fp8_weights
from moe_praxis.ops.fp8.mixed import mixed_grouped_gemm
from moe_praxis.ops.fp8.rule import Fp8Gemms
from tests.testutil import rel_err, row_errs, sum_err
from tests.testutil import seed as _seed

FP8_WEIGHTS = "fp8_weights"


def _labels(choices) -> dict[str, str]:
    """{weight: 'fwd+dgrad' | ... | 'none'} of a {weight: Fp8Gemms}."""
    return {w: c.label() for w, c in choices.items()}


@pytest.fixture(autouse=True)
def _on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_rule_at_the_measured_shapes_and_its_thresholds():
    """fwd always, dgrad K >= 4096, wgrad min(K, N) >= 4096 (pure arithmetic): the Mixtral-like
    FFN all in FP8, the Qwen3-like forward only, the DeepSeek-V3-like gate/up fwd + dgrad."""
    rule = fp8_rule.fp8_gemm_rule
    assert rule(4096, 14336).all and rule(14336, 4096).all
    assert rule(2048, 768) == Fp8Gemms(True, False, False) == rule(768, 2048)
    assert rule(7168, 2048) == Fp8Gemms(True, True, False)
    assert rule(2048, 7168) == Fp8Gemms(True, False, False)
    assert rule(4095, 8192) == Fp8Gemms(True, False, False)
    assert rule(4096, 4095) == Fp8Gemms(True, True, False)
    cfg = mp.MoEConfig(d_model=7168, d_ff=2048, num_experts=8, fp8="blockwise")
    assert _labels(cfg.fp8_choices()) == {"wi_gate": "fwd+dgrad", "wi_up": "fwd+dgrad", "wo": "fwd"}
    every = mp.MoEConfig(d_model=128, d_ff=128, num_experts=2, fp8="blockwise", fp8_gemms="all")
    assert all(c.all for c in every.fp8_choices().values())
    assert fp8_rule.shares(cfg.fp8_choices()) == {"fwd": 1.0, "dgrad": 2 / 3, "wgrad": 0.0}
    assert mp.MoEConfig(d_model=128, d_ff=128, num_experts=2).fp8_choices() == {}
    info = ops.backend_info(cfg)["fp8_gemms"]
    assert info["mode"] == "auto" and info["choice"]["wo"] == {
        "fwd": "fp8",
        "dgrad": "bf16",
        "wgrad": "bf16"
    }
    for bad in ("some", "fwd+fwd", "fwd+", "", "none", "Fwd"):
        with pytest.raises(
                ValueError,
                match=rf"MoEConfig.fp8_gemms={re.escape(repr(bad))} is invalid: valid: 'auto', "
                r"'all', or GEMMs from \('fwd', 'dgrad', 'wgrad'\) joined by '\+'"):
            mp.MoEConfig(d_model=128, d_ff=128, num_experts=2, fp8="blockwise", fp8_gemms=bad)


def test_gemms_named_by_hand_apply_to_every_weight_at_any_rows():
    """fp8_gemms 'fwd+dgrad' (TransformerEngine's override_linear_precision: wgrad in bf16),
    'dgrad+wgrad', ... : the named GEMMs of every expert weight in FP8, whatever the shape and
    the rows per expert ('auto' would run the bf16 layer under 2048)."""
    assert fp8_rule.parse("auto") is None and fp8_rule.parse("all") == fp8_rule.ALL
    assert fp8_rule.parse("wgrad+fwd") == Fp8Gemms(True, False, True)
    assert fp8_rule.parse("fwd+dgrad+wgrad") == fp8_rule.ALL
    for mode in ("fwd", "fwd+dgrad", "dgrad+wgrad"):
        cfg = mp.MoEConfig(d_model=128, d_ff=256, num_experts=4, fp8="blockwise", fp8_gemms=mode)
        assert {c.label() for c in cfg.fp8_choices().values()} == {mode}
        assert fp8_rule.form_pays(mode, 1) and not fp8_rule.form_pays("auto", 2047)
        info = ops.backend_info(cfg)["fp8_gemms"]
        assert info["mode"] == mode and info["choice"]["wo"]["wgrad"] == ("fp8" if "wgrad" in mode
                                                                          else "bf16")


def _block_runner(seed):
    """run(**MoEConfig fields) -> (MoEOutput.fp8_gemms as a dict, y, dx, dparams) of one block
    step at 16 rows per expert (4 experts, top-2, 2 x 16 tokens), the same inputs every call."""
    base = dict(d_model=256, d_ff=384, num_experts=4, top_k=2, kernel_backend="xla")
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = mp.init_moe_params(k1, mp.MoEConfig(**base))
    x = jax.random.normal(k2, (2, 16, 256), jnp.float32)
    cot = jax.random.normal(k3, x.shape, jnp.float32)

    def run(**kw):
        cfg = mp.MoEConfig(**base, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the emulation's notice
            ran = mp.moe_block(params, x, cfg).fp8_gemms
            (_, y), (dp, dx) = _block_step(cfg, cot, False)(params, x)
        return dict(ran), y, dx, dp

    return run


def test_named_gemms_reach_the_block():
    """At 16 rows per expert (where 'auto' runs the bf16 layer) the block runs the GEMMs named:
    'fwd+dgrad' has the forward and dx of 'all' (the same FP8 arithmetic, within float32
    rounding: 1e-5 norm-wise) and weight gradients that differ from them (bf16 wgrads, > 1e-3);
    'dgrad+wgrad' has the forward of the bf16 layer (fp8=None) and its weight gradients
    differ from the bf16 layer's. MoEOutput.fp8_gemms names what ran."""
    seed = _seed()
    run = _block_runner(seed)
    every = run(fp8="blockwise", fp8_gemms="all")
    named = run(fp8="blockwise", fp8_gemms="fwd+dgrad")
    back = run(fp8="blockwise", fp8_gemms="dgrad+wgrad")
    bf16, auto = run(), run(fp8="blockwise")
    assert {c.label() for c in named[0].values()} == {"fwd+dgrad"}
    assert {c.label() for c in back[0].values()} == {"dgrad+wgrad"}
    assert {c.label() for c in auto[0].values()} == {"none"}  # 16 rows per expert: bf16 layer
    assert rel_err(named[1], every[1]) < 1e-5 and rel_err(named[2], every[2]) < 1e-5, seed
    assert rel_err(back[1], bf16[1]) < 1e-5 and rel_err(every[1], bf16[1]) > 1e-3, seed
    for w in ("wi_gate", "wi_up", "wo"):
        assert rel_err(named[3][w], every[3][w]) > 1e-3, f"seed={seed} {w}: wgrad in FP8?"
        assert rel_err(back[3][w], bf16[3][w]) > 1e-3, f"seed={seed} {w}: wgrad in bf16?"


def test_the_per_weight_form_parses_and_names_what_is_wrong():
    """'wi=fwd,wo=none': {weight: Fp8Gemms} ('wi' both gate and up, weights not named NONE);
    an unknown, repeated or unnamed weight, GEMMs that are not, or no FP8 GEMM at all is a
    one-line error; wi_gate named for an FFN without a gate is an error, not ignored."""
    fwd = Fp8Gemms(True, False, False)
    assert fp8_rule.parse("wi=fwd,wo=none") == {"wi_gate": fwd, "wi_up": fwd, "wo": fp8_rule.NONE}
    assert fp8_rule.parse("wo=all") == {"wo": fp8_rule.ALL}
    cfg = mp.MoEConfig(d_model=128, d_ff=128, num_experts=2, fp8="blockwise", fp8_gemms="wo=fwd")
    assert _labels(cfg.fp8_choices()) == {"wi_gate": "none", "wi_up": "none", "wo": "fwd"}
    assert fp8_rule.form_pays("wo=fwd", 1)
    assert ops.backend_info(cfg)["fp8_gemms"]["choice"]["wi_up"]["fwd"] == "bf16"
    for bad in ("wi=fwd,wi_up=fwd", "wx=fwd", "=fwd", "wi=fwd,", "wi=some", "wi=none",
                "wi=fwd,wo=none,wi_gate=all", "wo=fwd+fwd"):
        with pytest.raises(ValueError, match=rf"fp8_gemms={re.escape(repr(bad))} is invalid"):
            fp8_rule.parse(bad)
        with pytest.raises(ValueError, match=r"is invalid: valid: .*per weight WEIGHT=GEMMS"):
            mp.MoEConfig(d_model=128, d_ff=128, num_experts=2, fp8="blockwise", fp8_gemms=bad)
    with pytest.raises(ValueError, match="runs no GEMM in FP8"):
        fp8_rule.parse("wi=none,wo=none")
    with pytest.raises(ValueError,
                       match=r"MoEConfig.fp8_gemms='wi_gate=fwd' is invalid: it names "
                       r"\['wi_gate'\], which an FFN with gated=False has not \(its weights: "
                       r"\('wi_up', 'wo'\)\)"):
        mp.MoEConfig(d_model=128,
                     d_ff=128,
                     num_experts=2,
                     gated=False,
                     activation="gelu",
                     fp8="blockwise",
                     fp8_gemms="wi_gate=fwd")


def test_the_per_weight_form_reaches_the_block():
    """Every weight named with the uniform form's GEMMs runs the uniform form bitwise (output
    and every gradient); 'wi=fwd' and 'wo=fwd' each run FP8 where they say: their outputs
    differ from the bf16 layer's and from each other's by more than 1e-3. Under 'wo=fwd' every
    gradient is the bf16 layer's (within float32 rounding, 1e-5 norm-wise): the backward reads
    bf16 gate and up outputs and runs wo's dgrad and wgrad in bf16; under 'wi=fwd' they
    differ (the gate and up outputs came from FP8)."""
    seed = _seed()
    run = _block_runner(seed)
    uniform = run(fp8="blockwise", fp8_gemms="fwd+dgrad")
    per = run(fp8="blockwise", fp8_gemms="wi_gate=fwd+dgrad,wi_up=dgrad+fwd,wo=fwd+dgrad")
    wi, wo = run(fp8="blockwise", fp8_gemms="wi=fwd"), run(fp8="blockwise", fp8_gemms="wo=fwd")
    bf16 = run()
    assert per[0] == uniform[0]
    for a, b in zip(jax.tree.leaves(per[1:]), jax.tree.leaves(uniform[1:])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _labels(wi[0]) == {"wi_gate": "fwd", "wi_up": "fwd", "wo": "none"}
    assert rel_err(wi[1], bf16[1]) > 1e-3 and rel_err(wo[1], bf16[1]) > 1e-3, seed
    assert rel_err(wi[1], wo[1]) > 1e-3, seed
    assert rel_err(wo[1], bf16[1]) < 0.1 and rel_err(wi[1], bf16[1]) < 0.1, seed
    assert rel_err(wo[2], bf16[2]) < 1e-5 and rel_err(wi[2], bf16[2]) > 1e-3, seed
    for w in ("wi_gate", "wi_up", "wo"):
        assert rel_err(wo[3][w], bf16[3][w]) < 1e-5, f"seed={seed} {w}"
        assert rel_err(wi[3][w], bf16[3][w]) > 1e-3, f"seed={seed} {w}"


def _gemm_inputs(seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (300, 256), jnp.bfloat16)
    w = jax.random.normal(k2, (4, 256, 384), jnp.float32) / 16
    dy = jax.random.normal(k3, (300, 384), jnp.bfloat16)
    return x, w, dy, jnp.array([0, 120, 1, 150], jnp.int32)  # 29 rows past the groups


def _out_and_grads(f, x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y, ) + vjp(dy)


@pytest.mark.parametrize("path", ["xla", "cuda"])
@pytest.mark.parametrize("gemms", [
    Fp8Gemms(True, False, False),
    Fp8Gemms(True, True, False),
    Fp8Gemms(False, True, True),
    Fp8Gemms(False, False, False),
],
                         ids=lambda g: g.label())
def test_mixed_gemm_is_fp8_where_chosen_and_bf16_elsewhere(monkeypatch, path, gemms):
    seed = _seed()
    x, w, dy, sizes = _gemm_inputs(seed)
    f8 = _out_and_grads(lambda a, b: fp8.fp8_grouped_gemm_path(a, b, sizes, path), x, w, dy)
    bf = _out_and_grads(lambda a, b: ops.grouped_gemm(a, b.astype(a.dtype), sizes, backend="xla"),
                        x, w, dy)
    monkeypatch.setattr(fp8, "resolve", lambda backend: path)
    got = _out_and_grads(lambda a, b: mixed_grouped_gemm(a, b, sizes, gemms, backend="xla"), x, w,
                         dy)
    assert got[2].dtype == jnp.float32 and got[0].dtype == jnp.bfloat16
    for i, name in enumerate(("fwd", "dgrad", "wgrad")):
        want = f8[i] if getattr(gemms, name) else bf[i]
        err = rel_err(got[i], want)
        assert err < 1e-6, f"seed={seed} {name}: {err}"
        assert rel_err(f8[i], bf[i]) > 1e-3, f"seed={seed} {name}: FP8 = bf16?"
    np.testing.assert_array_equal(np.asarray(got[0][271:], np.float32), 0)  # past the groups
    assert float(jnp.max(jnp.abs(got[2][0]))) == 0  # the empty group's weight gradient


def test_mixed_gemm_with_the_fp8_form_given_is_bitwise_the_same():
    x, w, dy, sizes = _gemm_inputs(_seed())
    fw = fp8_weights.quantize(w, transposed=False)
    gemms = Fp8Gemms(True, True, False)
    a = _out_and_grads(lambda a, b: mixed_grouped_gemm(a, b, sizes, gemms, backend="xla"), x, w, dy)
    b = _out_and_grads(lambda a, b: mixed_grouped_gemm(a, b, sizes, gemms, fw=fw, backend="xla"), x,
                       w, dy)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def _block_step(cfg, cot, once, **mesh):

    def loss(p, fws, x):
        q = p if fws is None else {**p, FP8_WEIGHTS: fws}
        o = mp.moe_block(q, x, cfg, **mesh)
        return jnp.sum((o.y * cot).astype(jnp.float32)), o.y

    grad = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)

    def step(p, x):
        fws = mp.quantize_expert_weights(p, cfg)[FP8_WEIGHTS] if once else None
        return grad(p, fws, x)

    return jax.jit(step)


def test_auto_on_fsdp_ep_mesh_equals_one_device():
    """fsdp4 x ep2, d_model 512 (the rule: every forward in FP8, dgrad and wgrad in bf16), the
    FP8 form made beforehand: dx and the weight gradients equal one device's within 1e-5
    norm-wise (float32 master weights and rows; the mesh only reorders float32 sums). y: every
    token's row within 1e-4 but at most 4 of the 160, each within 5e-2 (a reordered sum may move
    a SwiGLU output's last float32 bit, and with it a 1x128 tile's amax and scale: that row's
    tile rounds anew in e4m3: one row 1.6% off at one seed; a bf16 forward would be about 3%
    off on every row); the loss within 2e-3 of its terms' magnitudes (its terms cancel). The
    master weights are gathered for the bf16 GEMMs, the FP8 form in e4m3."""
    seed = _seed()
    cfg = mp.MoEConfig(d_model=512,
                       d_ff=384,
                       num_experts=8,
                       top_k=2,
                       kernel_backend="xla",
                       fp8="blockwise")
    assert {c.label() for c in cfg.fp8_choices().values()} == {"fwd"}
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = mp.init_moe_params(k1, cfg)
    x = jax.random.normal(k2, (8, 20, 512), jnp.float32)
    cot = jax.random.normal(k3, x.shape, jnp.float32)
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("fsdp", "ep"))
    res = mp.MeshResources(fsdp="fsdp", ep="ep", fsdp_dim="model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulation's notice
        one = _block_step(cfg, cot, True)(params, x)
        meshed = _block_step(cfg, cot, True, mesh=mesh, resources=res)
        got = meshed(params, x)
        hlo = meshed.lower(params, x).as_text()
    terms = jnp.sum(jnp.abs(one[0][1] * cot))  # the loss's terms' magnitudes
    err = sum_err(got[0][0], one[0][0], terms)
    assert err < 2e-3, f"seed={seed} loss: {err} of the terms' magnitudes"
    rows = row_errs(got[0][1], one[0][1]).ravel()
    assert np.sum(rows > 1e-4) <= 4 and rows.max() < 5e-2, f"seed={seed} y rows: {rows}"
    assert float(jnp.max(jnp.abs(got[0][1]))) > 0, f"seed={seed}: y is zero"
    for name, a, b in zip(["dx"] + [f"d{n}" for n in sorted(params)],
                          jax.tree.leaves((got[1][1], got[1][0])),
                          jax.tree.leaves((one[1][1], one[1][0]))):
        err = rel_err(a, b)
        assert err < 1e-5 and float(jnp.max(jnp.abs(a))) > 0, f"seed={seed} {name}: {err}"
    gathers = [line for line in hlo.splitlines() if "all_gather" in line]
    assert any("f8E4M3FN" in line for line in gathers), gathers
    for master in ("tensor<4x512x384xf32>", "tensor<4x384x512xf32>"):  # wi, wo of 4 experts
        assert any(line.endswith(master) for line in gathers), (master, gathers)


def test_layer_benchmark_reports_the_fp8_gemms(capsys):
    """benchmarks/layer.py's 'cuda+fp8' (fp8_gemms 'auto') and 'cuda+fp8all' name which GEMMs
    ran in FP8, at the DeepSeek-V3-like shape (the --quick shapes are too narrow for FP8)."""
    from benchmarks import layer_cases as lc
    from benchmarks import layer_report

    shape = lc.SHAPES["deepseek"]
    configs = {m: lc.config(shape, **lc.BLOCK_METHODS[m][0]) for m in ("cuda+fp8", "cuda+fp8all")}
    got = layer_report.fp8_gemms(configs)
    assert got["cuda+fp8"]["wi_up"] == {"fwd": "fp8", "dgrad": "fp8", "wgrad": "bf16"}
    assert got["cuda+fp8"]["wo"] == {"fwd": "fp8", "dgrad": "bf16", "wgrad": "bf16"}
    assert set(got["cuda+fp8all"]["wo"].values()) == {"fp8"}
    out = capsys.readouterr().out
    assert "cuda+fp8: fp8_gemms='auto', FP8 GEMMs: wi_gate fwd+dgrad, wi_up fwd+dgrad, wo fwd" in out
    # at the shape's 256 rows per expert a call quantizing its own weights runs the bf16 layer;
    # given the form ('cuda+fp8w') the rule's GEMMs run FP8; 'all' at any rows
    configs["cuda+fp8w"] = configs["cuda+fp8"]
    got = layer_report.fp8_gemms(configs, shape.t * shape.k / shape.e)
    assert set(got["cuda+fp8"]["wi_up"].values()) == {"bf16"}
    assert got["cuda+fp8w"]["wi_up"] == {"fwd": "fp8", "dgrad": "fp8", "wgrad": "bf16"}
    assert set(got["cuda+fp8all"]["wo"].values()) == {"fp8"}
    assert ("cuda+fp8: fp8_gemms='auto', FP8 GEMMs: wi_gate none, wi_up none, wo none (the "
            "weights' FP8 form would serve 256 rows per expert, under 2048: the bf16 layer)"
            in capsys.readouterr().out)
