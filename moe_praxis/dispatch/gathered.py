"""The gathered dispatcher (MoEConfig.gather_rows): no permuted copy of the rows; the experts'
first projection reads x's rows by the dispatch's row map (ops.gathered_gemm,
ops.gathered_gate_up_swiglu). Its expert implementation: moe_praxis.experts.gathered.

Letters: T tokens, R rows (token copies), M d_model.
"""

from __future__ import annotations

import jax

from moe_praxis.config import MoEConfig
from moe_praxis.ops import backend as ops_backend
from moe_praxis.ops import vma
from moe_praxis.ops.gate_up import gathered_unsupported
from moe_praxis.ops.gathered_gemm import gather_unsupported
from moe_praxis.variants import Entry, Query, Rows


def gathers_rows(config: MoEConfig, x, weights, backend: str) -> bool:
    """True where the experts read the rows from x by index (config.gather_rows): on the XLA
    path, and on CUDA where the gathered kernels run these weights (elsewhere on CUDA: False,
    with a warning naming why, and the block permutes as without the flag). x and weights:
    arrays or ShapeDtypeStructs (only shapes and dtypes are read)."""
    if not config.gather_rows:
        return False
    if ops_backend.op_backend(backend, "grouped_gemm") == "xla":
        return True
    # the weights as the experts cast them (shapes and dtypes only: nothing traced)
    cast = {
        n: jax.ShapeDtypeStruct(w.shape, x.dtype)
        for n, w in weights.items() if n.startswith("wi")
    }
    if config.fuse_gate_up:
        why = gathered_unsupported(x, cast["wi_gate_up"], config.activation, "cuda")
    else:
        names = ("wi_gate", "wi_up") if config.gated else ("wi_up", )
        why = gather_unsupported(x, tuple(cast[n] for n in names), "cuda")
    if why:
        ops_backend.warn_once(
            f"MoEConfig.gather_rows=True is not honoured here: {why}. The dispatch permutes the "
            "rows instead.", RuntimeWarning)
    return not why


def _choose(q: Query) -> str:
    if gathers_rows(q.config, q.x, q.weights, q.backend):
        return "gather_rows: the first projection reads x's rows by index, no permuted copy"
    return ""


def _local(x, d, index, *, backend, axes) -> Rows:
    del backend
    return Rows(tokens=(vma.vary(x, axes), d.row_map, index))


def _regrouped(rows, perm) -> Rows:
    return Rows(tokens=(rows, perm, None))


DISPATCHER = Entry("gathered_index", _choose, _local, regrouped=_regrouped, form="tokens")
