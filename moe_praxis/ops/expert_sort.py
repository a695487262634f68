"""Sort the token copies by expert: the dispatch's stable sort.

    keys: [R] int, R = T * k, keys[t * k + j] = the expert of token t's j-th copy; a key
          outside [0, E) marks a copy that is not kept (dropped or padded) and sorts as E,
          after every expert.
    -> order [R] int32        the copy at each sorted position (stable: each expert's copies,
                              and the copies not kept, in copy order)
       sorted_keys [R] int32  its key (E for a copy not kept)
       row_map [R] int32      its token, order // k (T for a copy not kept)
       group_sizes [E] int32  the copies of each expert

Backends ('auto' | 'xla' | 'cuda'):
  xla:  jnp.argsort(stable=True) and bincount (`expert_sort_reference`).
  cuda: kernels/expert_sort.cu, a counting sort in three small kernels (chunk histograms, their
        offsets, a stable scatter), for E <= 1024 (the kernel's counters live in shared memory);
        more experts run the reference with a warning. Both give the same integers: a stable
        sort has one answer.
On the GPU, XLA's sort is a cub radix sort (with the gathers and counts around it, 18 kernels in
the Qwen3-like dispatch) that, with XLA's command buffers on, left the GPU idle about 0.3 ms per
step (docs/performance.md); the kernels are graph-safe. Used by the dispatch (sort_copies), the
capacity's keep mask and the expert-parallel regroup. The outputs are integers: nothing to
differentiate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_praxis.ops import backend as _backend
from moe_praxis.ops._library import ffi, platform_call

MAX_EXPERTS = 1024  # kernels/expert_sort.cu: kMaxExperts
CHUNK = 4096  # kernels/expert_sort.cu: kChunk (keys per block; the workspace has a row each)


def expert_sort_reference(keys, num_experts: int, k: int):
    """(order, sorted_keys, row_map, group_sizes) of keys [R] (module docstring)."""
    e = num_experts
    r = keys.shape[0]
    key = jnp.where((keys >= 0) & (keys < e), keys, e).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_keys = key[order]
    row_map = jnp.where(sorted_keys < e, order // k, r // k).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    return order, sorted_keys, row_map, group_sizes


def _sort_ffi(num_experts, k, keys):
    r = keys.shape[0]
    chunks = max(-(-r // CHUNK), 1)
    rows = jax.ShapeDtypeStruct((r, ), jnp.int32)
    outs = ffi("moe_expert_sort", (rows, rows, rows, jax.ShapeDtypeStruct(
        (num_experts, ), jnp.int32), jax.ShapeDtypeStruct(
            (chunks * (num_experts + 1), ), jnp.int32)),
               keys,
               experts=int(num_experts),
               k=int(k))
    return tuple(outs[:4])


def expert_sort_cuda(keys, num_experts: int, k: int):
    """The sort kernels (the reference where not lowered for CUDA)."""
    return platform_call(functools.partial(_sort_ffi, num_experts, k),
                         functools.partial(expert_sort_reference, num_experts=num_experts, k=k),
                         keys)


def expert_sort_unsupported(keys, num_experts: int, k: int) -> str:
    """'' if the sort kernels handle these inputs, else why not."""
    if keys.ndim != 1:
        return f"keys must be [R], got shape {keys.shape}"
    if num_experts > MAX_EXPERTS:
        return f"num_experts={num_experts} (the kernel counts in shared memory: <= {MAX_EXPERTS})"
    if keys.shape[0] >= 2**31:
        return f"{keys.shape[0]} keys (int32 positions: < 2**31)"
    return ""


def expert_sort(keys, num_experts: int, k: int, *, backend: str = "auto"):
    """keys: [R] int (R a multiple of k) -> (order, sorted_keys, row_map, group_sizes), the
    stable sort of the copies by expert (module docstring). backend 'cuda': the sort kernels."""
    if num_experts < 1 or k < 1 or keys.ndim != 1 or keys.shape[0] % k:
        raise ValueError(f"expert_sort: keys of shape {keys.shape}, num_experts={num_experts}, "
                         f"k={k} are invalid; valid: keys [R] with R a multiple of k >= 1, "
                         f"num_experts >= 1")
    keys = keys.astype(jnp.int32)
    if _backend.op_backend(backend, "permute") == "cuda":
        why = expert_sort_unsupported(keys, num_experts, k)
        if not why:
            return expert_sort_cuda(keys, int(num_experts), int(k))
        _backend.warn_fallback("expert_sort", why)
    return expert_sort_reference(keys, num_experts, k)
