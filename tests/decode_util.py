"""The decoding protocol the KV-cache tests share (test_stack_decode.py, test_attention.py).

TransformerLm decodes by a full-length fprop with ``start_time_step=P`` that fills every
attention layer's decode cache (DECODE_CACHE) and sets the time step to P; each extend_step
then computes position t from the cache of positions < t."""

import jax
import jax.numpy as jnp

from praxis import base_layer

CACHE = base_layer.DECODE_CACHE


def context(do_eval=True):
    return base_layer.JaxContext.new_context(hparams=base_layer.JaxContext.HParams(do_eval=do_eval))


def prefill(lm, variables, ids, start):
    """The fprop of ids [B, T] with start_time_step=start: (logits [B, T, V], the cache)."""

    def fprop(v):
        with context():
            out, upd = lm.apply(v,
                                ids,
                                jnp.zeros(ids.shape, jnp.float32),
                                start_time_step=start,
                                mutable=[CACHE])
        return out.logits, upd[CACHE]

    return jax.jit(fprop)(variables)


def extend_steps(lm, variables, cache, ids, start):
    """extend_step over columns start..T-1 of ids [B, T] from ``cache``: yields (t, logits
    [B, V] for position t, the cache after it)."""

    def step(v, cache, tok):
        with context():
            out, upd = lm.apply(dict(v, **{CACHE: cache}),
                                tok,
                                method=lm.extend_step,
                                mutable=[CACHE])
        return out.logits, upd[CACHE]

    step = jax.jit(step)
    for t in range(start, ids.shape[1]):
        logits, cache = step(variables, cache, ids[:, t])
        yield t, logits, cache
