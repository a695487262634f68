"""use_cudnn_fusion: an optional dependency that never breaks import or tests."""

import sys
import warnings

import jax
import numpy as np
import pytest

import moe_praxis as mp
from moe_praxis import experts
from moe_praxis.ops import backend as ops_backend


def test_import_does_not_import_cudnn():
    assert not any(name == "cudnn" or name.startswith("cudnn.") for name in sys.modules)


def test_fusion_flag_warns_once_with_reason_and_falls_back():
    ops_backend.reset_warnings()
    cfg = mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2)
    fused = mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, use_cudnn_fusion=True)
    params = mp.init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (5, 8))
    usable, why = experts.cudnn_fusion_status()
    assert not usable and why
    with pytest.warns(RuntimeWarning, match="use_cudnn_fusion=True is not honoured here") as rec:
        y1 = mp.moe_block(params, x, fused).y
    assert why in str(rec[0].message) and "instead" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call does not warn again
        y2 = mp.moe_block(params, x, fused).y
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(mp.moe_block(params, x, cfg).y))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))


def test_strict_env_var_makes_the_fallback_an_error(monkeypatch):
    """MOE_PRAXIS_STRICT_CUDNN_FUSION=1: the unhonoured flag raises, naming the reason and the
    variable; an invalid value is refused by name; 0 keeps the warning."""
    fused = mp.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, use_cudnn_fusion=True)
    params = mp.init_moe_params(jax.random.key(0), fused)
    x = jax.random.normal(jax.random.key(1), (5, 8))
    _, why = experts.cudnn_fusion_status()
    monkeypatch.setenv(experts.ENV_STRICT_CUDNN, "1")
    with pytest.raises(RuntimeError, match="MOE_PRAXIS_STRICT_CUDNN_FUSION=1") as err:
        mp.moe_block(params, x, fused)
    assert why in str(err.value)
    monkeypatch.setenv(experts.ENV_STRICT_CUDNN, "yes")
    with pytest.raises(ValueError, match="MOE_PRAXIS_STRICT_CUDNN_FUSION='yes' is invalid"):
        mp.moe_block(params, x, fused)
    monkeypatch.setenv(experts.ENV_STRICT_CUDNN, "0")
    ops_backend.reset_warnings()
    with pytest.warns(RuntimeWarning, match="MOE_PRAXIS_STRICT_CUDNN_FUSION=1 makes this an error"):
        mp.moe_block(params, x, fused)
