"""The experts in the input dtype (config.fp8 None), on expert-sorted rows: one registry entry
per fusion of the gate/up projections, the activation and the down projection.

Letters: R rows, M d_model, H d_ff, E experts (local experts under expert parallelism).
Every entry runs `run(rows: variants.Rows, group_sizes [E], weights, config, *, backend,
row_weights) -> [R, M]` (moe_praxis.experts states the contract).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.variants import Entry, Query, Rows


def down(gate, up, weights, group_sizes, config: MoEConfig, backend, row_weights, dt):
    """The activation of (gate, up) [R, H] ('ffn1'; gate None where not gated), times the
    routing weight, then the down projection ('ffn2') -> [R, M]; with config.fuse_swiglu_bwd
    one op (ops.swiglu_down: dSwiGLU in the down projection's dgrad epilogue)."""
    wo = weights["wo"].astype(dt)
    if config.gated:
        if config.fuse_swiglu_bwd:
            out = ops.swiglu_down(gate,
                                  up,
                                  wo,
                                  group_sizes,
                                  row_weights,
                                  act=config.activation,
                                  backend=backend)
            return checkpoint_name(out, "ffn2")
        act = ops.swiglu(gate, up, row_weights, act=config.activation, backend=backend)
    else:
        act = ops.activation(config.activation)(up)
        if row_weights is not None:
            act = (act.astype(jnp.float32) * row_weights.astype(jnp.float32)[:, None]).astype(dt)
    act = checkpoint_name(act, "ffn1")
    return checkpoint_name(ops.grouped_gemm(act, wo, group_sizes, backend=backend), "ffn2")


def named_projections(outs, config: MoEConfig):
    """(gate or None, up) of the projections' outputs (gate first where gated), each under its
    checkpoint name."""
    return ops.named_gate_up(outs[0] if config.gated else None, outs[-1])


def _projected(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights):
    """Separate gate and up projections (rows.rows_up for up where given; from rows.source,
    gathered again in their backward, where given: ops.regathered_gemms), then `down`."""
    names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
    if rows.source is not None:
        x, row_map, index = rows.source
        dt = x.dtype
        outs = ops.regathered_gemms(x,
                                    row_map,
                                    tuple(weights[n].astype(dt) for n in names),
                                    group_sizes,
                                    backend=backend,
                                    index=index)
    else:
        dt = rows.rows.dtype
        lhs = {"wi_gate": rows.rows, "wi_up": rows.rows if rows.rows_up is None else rows.rows_up}
        outs = tuple(
            ops.grouped_gemm(lhs[n], weights[n].astype(dt), group_sizes, backend=backend)
            for n in names)
    gate, up = named_projections(outs, config)
    return down(gate, up, weights, group_sizes, config, backend, row_weights, dt)


def _gate_up(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights):
    """One grouped GEMM against wi_gate_up with the SwiGLU fused (ops.gate_up_swiglu; from
    rows.source, gathered again in its backward, where given: ops.gate_up_swiglu_regathered),
    then the down projection."""
    if rows.source is not None:
        x, row_map, index = rows.source
        dt = x.dtype
        act = ops.gate_up_swiglu_regathered(x,
                                            row_map,
                                            weights["wi_gate_up"].astype(dt),
                                            group_sizes,
                                            row_weights,
                                            act=config.activation,
                                            backend=backend,
                                            index=index)
    else:
        dt = rows.rows.dtype
        act = ops.gate_up_swiglu(rows.rows,
                                 weights["wi_gate_up"].astype(dt),
                                 group_sizes,
                                 row_weights,
                                 act=config.activation,
                                 backend=backend)
    act = checkpoint_name(act, "ffn1")
    wo = weights["wo"].astype(dt)
    return checkpoint_name(ops.grouped_gemm(act, wo, group_sizes, backend=backend), "ffn2")


def _gate_up_down(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights):
    """The fused gate/up GEMM and the down projection as one op (ops.gate_up_swiglu_down)."""
    dt = rows.rows.dtype
    out = ops.gate_up_swiglu_down(rows.rows,
                                  weights["wi_gate_up"].astype(dt),
                                  weights["wo"].astype(dt),
                                  group_sizes,
                                  row_weights,
                                  act=config.activation,
                                  backend=backend)
    return checkpoint_name(out, "ffn2")


def _when(test, reason):
    return lambda q: reason if q.config.fp8 is None and test(q.config) else ""


GATE_UP_DOWN = Entry(
    "gate_up_swiglu_down",
    _when(lambda c: c.fuse_gate_up and c.fuse_swiglu_bwd,
          "fuse_gate_up and fuse_swiglu_bwd: one op from the rows to the down projection"),
    _gate_up_down)
GATE_UP = Entry(
    "gate_up_swiglu",
    _when(lambda c: c.fuse_gate_up,
          "fuse_gate_up: one grouped GEMM for gate and up, the SwiGLU fused"), _gate_up)
SWIGLU_DOWN = Entry(
    "swiglu_down",
    _when(lambda c: c.gated and c.fuse_swiglu_bwd,
          "fuse_swiglu_bwd: the SwiGLU backward in the down projection's dgrad"), _projected)
SWIGLU = Entry("swiglu", _when(lambda c: c.gated, "gated: grouped GEMMs gate and up, the SwiGLU"),
               _projected)
PLAIN = Entry("plain", _when(lambda c: not c.gated, "gated=False: act(x @ wi_up) @ wo"), _projected)
