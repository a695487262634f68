"""Stage-by-stage run of the group-limited router on a GPU (prints before and after each
stage, so a hang or crash names its stage): `python -m experiments.debug_router_groups`."""
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_praxis import routing
from moe_praxis.ops import cuda
from tests import kernel_reference as ref
from tests.testutil import router_config


def stage(name, fn):
    print(f"[{time.strftime('%X')}] {name} ...", flush=True)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    print(f"[{time.strftime('%X')}] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main():
    for (t, e, k, sf, pre, norm, g, gk, sc,
         ub) in [(4, 256, 8, "sigmoid", True, True, 8, 4, 2.5, True),
                 (4099, 256, 8, "sigmoid", True, True, 8, 4, 2.5, True),
                 (777, 256, 8, "softmax", True, True, 16, 2, 1.0, False)]:
        print(f"case T={t} E={e} k={k} {sf} groups={g} group_topk={gk}", flush=True)
        cfg = router_config(e, k, sf, pre, norm, g, gk, sc, ub)
        logits = 2.0 * jax.random.normal(jax.random.key(0), (t, e), jnp.float32)
        bias = 0.1 * jax.random.normal(jax.random.key(1), (e, )) if ub else jnp.zeros((e, ))
        pk, ik, wk = stage("kernel fwd", lambda: jax.jit(functools.partial(cuda.fused_router, cfg))
                           (logits, bias))
        r = stage(
            "jax reference fwd",
            lambda: jax.jit(lambda l, b: routing.route_logits_reference(l, cfg, b))(logits, bias))
        p64, i64, w64 = stage(
            "numpy reference", lambda: ref.router(np.asarray(logits),
                                                  top_k=k,
                                                  score_func=sf,
                                                  pre_softmax=pre,
                                                  norm_topk=norm,
                                                  groups=g,
                                                  group_topk=gk,
                                                  scaling=sc,
                                                  bias=np.asarray(bias)))
        same = np.all(np.asarray(ik) == np.asarray(r.expert_ids), 1)
        print(
            f"  ids equal (jax ref): {same.mean():.4f}; (numpy): "
            f"{np.all(np.asarray(ik) == i64, 1).mean():.4f}; probs err "
            f"{ref.rel_err(pk, r.probs):.2e}; weights err (same ids) "
            f"{ref.rel_err(np.asarray(wk)[same], np.asarray(r.weights)[same]):.2e}",
            flush=True)
        dl = stage(
            "kernel bwd", lambda: jax.jit(lambda l: jax.vjp(
                lambda x: (lambda o: (o[0], o[2]))(cuda.fused_router(cfg, x, bias)), l)[1]
                                          ((jnp.ones((t, e)), jnp.ones((t, k))))[0])(logits))
        dr = stage(
            "jax reference bwd", lambda: jax.jit(lambda l: jax.vjp(
                lambda x: (lambda o: (o.probs, o.weights))
                (routing.route_logits_reference(x, cfg, bias)), l)[1]((jnp.ones(
                    (t, e)), jnp.ones((t, k))))[0])(logits))
        print(
            f"  dlogits err (same ids) {ref.rel_err(np.asarray(dl)[same], np.asarray(dr)[same]):.2e}",
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
