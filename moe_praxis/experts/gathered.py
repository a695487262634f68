"""The experts reading x's rows by index (the gathered dispatcher, MoEConfig.gather_rows): the
gate and up projections are one gathered op (ops.gathered_gemm, or ops.gathered_gate_up_swiglu
with fuse_gate_up) reading x [T, M] by the row map, then the activation and the down
projection as in moe_praxis.experts.bf16.

Letters: T tokens, R rows, M d_model, H d_ff, E experts. `run(rows: variants.Rows with
tokens=(x, row_map, index), group_sizes [E], weights, config, *, backend, row_weights) ->
[R, M]`.
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

from moe_praxis import ops
from moe_praxis.config import MoEConfig
from moe_praxis.experts.bf16 import down, named_projections
from moe_praxis.variants import Entry, Query, Rows


def _gathered(rows: Rows, group_sizes, weights, config: MoEConfig, *, backend, row_weights):
    x, row_map, index = rows.tokens
    dt = x.dtype
    if config.fuse_gate_up:
        act = ops.gathered_gate_up_swiglu(x,
                                          row_map,
                                          weights["wi_gate_up"].astype(dt),
                                          group_sizes,
                                          row_weights,
                                          index=index,
                                          act=config.activation,
                                          backend=backend)
        act = checkpoint_name(act, "ffn1")
        wo = weights["wo"].astype(dt)
        return checkpoint_name(ops.grouped_gemm(act, wo, group_sizes, backend=backend), "ffn2")
    names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
    outs = ops.gathered_gemm(x,
                             row_map,
                             tuple(weights[n].astype(dt) for n in names),
                             group_sizes,
                             backend=backend,
                             index=index)
    gate, up = named_projections(outs, config)
    return down(gate, up, weights, group_sizes, config, backend, row_weights, dt)


def _choose(q: Query) -> str:
    return "the rows are read from x by index (the gathered dispatcher)" if q.config.fp8 is None \
        else ""


EXPERTS = Entry("gathered", _choose, _gathered, form="tokens")
