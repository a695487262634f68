"""Grouped GEMM with jax.lax.ragged_dot semantics.

    out[i] = lhs[i] @ rhs[g(i)]   for rows i < sum(group_sizes), g(i) the group of row i
    out[i] = 0                    for rows i >= sum(group_sizes)

lhs: [M, K]; rhs: [E, K, N]; group_sizes: [E] int32 (rows of each group, contiguous, in
order). Gradients: dlhs is a grouped GEMM against rhs^T; drhs[e] = lhs_e^T @ dout_e ([E,K,N],
zero for empty groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_gemm_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """Pure-JAX reference: jax.lax.ragged_dot."""
    return jax.lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=preferred_element_type
    )


def grouped_gemm(lhs, rhs, group_sizes, *, backend: str = "auto"):
    """[M, K] x [E, K, N] -> [M, N] grouped by `group_sizes`; output in lhs.dtype."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_gemm needs lhs [M,K], rhs [E,K,N]; got {lhs.shape}, {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must be [E={rhs.shape[0]}], got {group_sizes.shape}")
    del backend  # the CUDA grouped GEMM plugs in here (issue: CUDA FFI kernels, part 2)
    return grouped_gemm_reference(lhs, rhs, group_sizes)
