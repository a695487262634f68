"""Causal self-attention that does not materialize the logits on CUDA: the pure functions under
``moe_praxis.praxis.attention.GroupedQueryAttention``.

Letters: B batch, T query length, S key length, N query heads, K key/value heads (N % K == 0;
each key/value head serves G = N / K query heads), H head dim.

``attend(q, k, v, atten_mask, plan)`` runs one of three routes, chosen once per trace by
``choose(...)`` (a small frozen ``AttentionPlan`` with the reason, logged once):

- ``xla``: ``jax.nn.dot_product_attention(implementation='xla')`` under Praxis's own mask
  (``atten_mask > large_negative / 2``), so any mask Praxis builds (padding, packed segments,
  causal) is applied exactly; it materializes [B, N, T, S] logits.
- ``cudnn`` on unpacked rows: ``jax.nn.dot_product_attention(implementation='cudnn',
  is_causal=True)``, cuDNN's fused flash attention. It does NOT read ``atten_mask``: the rows
  must be unpadded and unpacked, so that Praxis's mask is the causal mask (the train and eval
  steps' batches: ``experiments.train.steps`` passes no paddings).
- ``cudnn`` on packed rows (``packed=True``): cuDNN's packed (THD) layout through
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (the function that
  ``jax.nn.dot_product_attention`` wraps; its public signature does not take segment offsets
  yet), with each row's segments as offsets and lengths and a padding-causal mask: a token
  attends to the earlier tokens of its own segment only. The segments are read from Praxis's
  mask itself (``segment_starts``): token t starts a segment where it may not attend to token
  t - 1. This equals Praxis's causal segment mask wherever each segment id occupies one
  contiguous run of the row (``experiments.data.packing``'s rows: pieces 1, 2, ..., then a padding
  run of 0s).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from absl import logging
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

IMPLS = ("auto", "xla", "cudnn")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Which route runs, and why (the reason is what the log line says)."""
    impl: str  # 'xla' or 'cudnn'
    packed: bool  # cudnn only: the packed (segment offsets) route
    reason: str


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention_impl={impl!r} is invalid; valid: "
                         f"{', '.join(repr(i) for i in IMPLS)}")


def cudnn_unsupported(q: jax.Array, k: jax.Array, v: jax.Array, packed: bool) -> Optional[str]:
    """Why cuDNN's flash attention cannot run q [B, T, N, H], k, v [B, S, K, H] here (None:
    it can). Asks jax's own cuDNN checks (backend, cuDNN present, head dim, architecture)."""
    backend = jax.default_backend()
    if backend != "gpu" or "cuda" not in jax.devices()[0].client.platform_version:
        return f"the backend is {backend!r}, not CUDA"
    dtype = jnp.dtype(q.dtype)
    if dtype not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"dtype {dtype.name} (cuDNN flash attention takes bfloat16 or float16)"
    try:
        version = cudnn_fa.check_cudnn_version()
        cudnn_fa.check_is_flash_attention(q,
                                          k,
                                          v,
                                          cudnn_fa.AttentionLayout.BTNH.value,
                                          version,
                                          has_bias=False,
                                          is_training=True,
                                          is_packed=packed)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        return str(e).strip().splitlines()[0]
    return None


_LOGGED = set()


def choose(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, *, packed: bool,
           need_mask: bool) -> AttentionPlan:
    """The route for these shapes and dtypes. impl: 'auto' (cudnn where it can run, else xla),
    'xla', or 'cudnn' (an error naming why where it cannot run). packed: the rows hold packed
    segments. need_mask: the mask is not the causal or packed-causal one (rows with padding,
    e.g. the sampler's prefill): only the xla route applies it exactly."""
    check_impl(impl)
    if impl == "xla":
        plan = AttentionPlan("xla", False, "attention_impl='xla'")
    else:
        why = ("the rows carry padding (only the xla route applies that mask)"
               if need_mask else cudnn_unsupported(q, k, v, packed))
        if why is not None and impl == "cudnn":
            raise ValueError(f"attention_impl='cudnn' cannot run: {why}; use 'auto' or 'xla'")
        if why is not None:
            plan = AttentionPlan("xla", False, f"attention_impl='auto': cuDNN cannot run: {why}")
        else:
            plan = AttentionPlan(
                "cudnn", packed, f"attention_impl={impl!r}: cuDNN flash attention" +
                (" with packed segments" if packed else ", causal"))
    msg = (f"attention: {plan.impl} route (q {tuple(q.shape)} {jnp.dtype(q.dtype).name}, "
           f"{k.shape[2]} kv heads): {plan.reason}")
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logging.info(msg)
    return plan


def allowed(atten_mask: jax.Array) -> jax.Array:
    """Praxis's additive mask (0 or a large negative number) as booleans (True: attend)."""
    return atten_mask > jnp.finfo(atten_mask.dtype).min / 4


def segment_starts(atten_mask: jax.Array) -> jax.Array:
    """atten_mask [B|1, 1, T, T] -> [B|1, T] bool: token t starts a segment (t == 0, or it
    may not attend to token t - 1). Reads only the mask's first subdiagonal."""
    ok = allowed(atten_mask[:, 0])
    sub = jnp.diagonal(ok, offset=-1, axis1=1, axis2=2)  # [B, T-1]: may t attend to t - 1
    first = jnp.ones(sub.shape[:1] + (1, ), bool)
    return jnp.concatenate([first, ~sub], axis=1)


def segment_offsets(starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """starts [B, T] bool -> (lengths [B, T] int32, offsets [B, T + 1] int32) in the form of
    cuDNN's packed layout (``fused_attention_stablehlo.dot_product_attention``'s q_offsets and
    q_seqlen with M = T segments at most): row b's segments begin at offsets[b, :m] and have
    lengths lengths[b, :m] (m its number of segments); the rest is -1 (cuDNN's own
    ``_fix_seqlen_offsets`` packs the rows' entries together and closes the last segment)."""
    b, t = starts.shape
    pos = jnp.arange(t, dtype=jnp.int32)
    count = jnp.sum(starts, axis=1, dtype=jnp.int32)  # [B]
    # The start positions of each row, in order, padded with T.
    begin = jnp.sort(jnp.where(starts, pos[None, :], t), axis=1)  # [B, T]
    end = jnp.concatenate([begin[:, 1:], jnp.full((b, 1), t, jnp.int32)], axis=1)
    end = jnp.where(pos[None, :] + 1 < count[:, None], end, t)
    valid = pos[None, :] < count[:, None]
    lengths = jnp.where(valid, end - begin, -1)
    offsets = jnp.concatenate(
        [jnp.where(valid, begin, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths.astype(jnp.int32), offsets.astype(jnp.int32)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, atten_mask: jax.Array, plan: AttentionPlan,
           scale: float) -> jax.Array:
    """softmax(scale * q k^T + mask) v per head: q [B, T, N, H], k, v [B, S, K, H],
    atten_mask [B|1, 1, T|1, S] (Praxis's additive mask) -> [B, T, N, H]. Softmax in float32;
    the route is ``plan``'s (module docstring)."""
    if plan.impl == "xla":
        return jax.nn.dot_product_attention(q,
                                            k,
                                            v,
                                            mask=allowed(atten_mask),
                                            scale=scale,
                                            implementation="xla")
    if not plan.packed:
        return jax.nn.dot_product_attention(q,
                                            k,
                                            v,
                                            scale=scale,
                                            is_causal=True,
                                            implementation="cudnn")
    starts = jnp.broadcast_to(segment_starts(atten_mask), q.shape[:2])
    lengths, offsets = segment_offsets(starts)
    return cudnn_fa.dot_product_attention(q,
                                          k,
                                          v,
                                          q_seqlen=lengths,
                                          kv_seqlen=lengths,
                                          q_offsets=offsets,
                                          kv_offsets=offsets,
                                          scale=scale,
                                          mask_type=cudnn_fa.MaskType.PADDING_CAUSAL,
                                          qkv_layout="BTNH")


def routes() -> list[str]:
    """The route lines logged so far in this process (one per distinct choice)."""
    return sorted(_LOGGED)
