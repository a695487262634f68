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
    with pytest.warns(UserWarning, match="use_cudnn_fusion=True is not honoured here") as rec:
        y1 = mp.moe_block(params, x, fused).y
    assert why in str(rec[0].message) and "instead" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call does not warn again
        y2 = mp.moe_block(params, x, fused).y
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(mp.moe_block(params, x, cfg).y))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
