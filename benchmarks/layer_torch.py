"""The PyTorch peer of `python -m benchmarks.layer`: the method 'torch'.

A TorchTitan-style MoE layer on the same inputs as the JAX methods, timed in the same process
after them with CUDA events:

  router    float32 logits x @ w_router, softmax (or DeepSeek-V3's sigmoid with expert groups
            and the expert bias, as moe_praxis.ops.router computes it), top-k, renormalised
            (MoEConfig.norm_topk), times routed_scaling_factor
  dispatch  a stable sort of the T*k token copies by expert, a row gather of x
  experts   gate and up as two `torch._grouped_mm` calls with device offsets (the groups'
            cumulative sizes), SiLU(gate) * up, down as a third `torch._grouped_mm`
  combine   the routing weight times each row, `index_add_` back to the tokens

Rows (method names): 'torch' (eager), 'torch compile' (`torch.compile` of the same function)
and 'torch ideal' (torch's own dense GEMMs of the expert shapes on T*k rows: 3 fwd, 9
fwd+bwd). fwd = the layer; fwd+bwd = autograd of sum(y * cot) w.r.t. x and every weight.
Before timing, the layer's y and dx on the first `layer_check.check_tokens(shape)` tokens (the
JAX methods' check: at most 2048, fewer where XLA's dense-masked ragged_dot would hold more
than CHECK_BYTES) are checked against moe_block with kernel_backend 'xla' (||a - b|| / ||b||
under CHECK_TOL, bf16); a failed check
marks the rows and they are not timed. Weights and inputs cross from JAX through DLPack.

Without torch (or without a CUDA GPU for it) `unavailable()` says why and the method is
skipped with one line. The JAX methods' rows get `x_torch` = the faster torch row's ms / ms.
"""

from __future__ import annotations

import statistics
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import moe_praxis as mp
from benchmarks import layer_cases as lc
from benchmarks.layer_check import check_tokens

try:  # optional: the GPU machine has PyTorch, CI does not
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

METHODS = ("torch", "torch compile", "torch ideal")
CHECK_TOL = 2e-2


def unavailable() -> str | None:
    """Why the 'torch' method cannot run here (None: it can)."""
    if torch is None:
        return "PyTorch is not importable"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


def to_torch(a):
    """A JAX array -> a torch tensor on the GPU with its own memory (DLPack, then a copy)."""
    return torch.from_dlpack(jax.device_put(a, jax.devices()[0])).to("cuda").clone()


def route(x, w_router, routing: dict, k: int, bias=None):
    """x [T, M] -> (expert ids [T, k] int64, weights [T, k] float32), float32 math as
    moe_praxis.ops.router: softmax top-k, or sigmoid with the bias in the choice only and
    DeepSeek-V3's expert groups (a group's score: the sum of its top 2)."""
    logits = x.float() @ w_router.float()
    if routing.get("score_func", "softmax") == "softmax":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
    else:
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.float()
    groups = routing.get("num_expert_groups", 1)
    if groups > 1:
        t, e = choice.shape
        g = choice.view(t, groups, e // groups)
        gscore = g.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore).scatter_(1,
                                                 gscore.topk(routing["group_topk"], -1).indices,
                                                 1.0)
        choice = (g * keep[..., None] + (keep[..., None] - 1) * 1e30).view(t, e)
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if routing.get("norm_topk", True):
        w = w / w.sum(-1, keepdim=True)
    return ids, w * routing.get("routed_scaling_factor", 1.0)


def moe_layer(x, w_router, wg, wu, wo, routing: dict, k: int, bias=None):
    """x [T, M] bf16 -> y [T, M] bf16: the TorchTitan-style layer of the module docstring.
    wg, wu [E, M, H], wo [E, H, M] bf16; w_router [M, E] float32."""
    ids, w = route(x, w_router, routing, k, bias)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # copies sorted by expert, ties by token
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=wg.shape[0]), 0).to(torch.int32)
    rows = x[token]
    h = F.silu(torch._grouped_mm(rows, wg, offs=offs)) * torch._grouped_mm(rows, wu, offs=offs)
    out = torch._grouped_mm(h, wo, offs=offs)
    out = out * w.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out)


def reference(jax_shape):
    """(n, y, dx) of moe_block (kernel_backend 'xla') on the first n = check_tokens(shape)
    tokens, in float32 on the host: computed before the peer's tensors take device memory, so
    JAX's allocator grows for it (if it must) while torch holds nothing. (At deepseek_ep4 2048
    tokens asked XLA for 28 GiB and ran out of memory on an H100; check_tokens gives 1024.)"""
    shape = jax_shape.shape
    n = check_tokens(shape)
    cfg = lc.config(shape, kernel_backend="xla")

    def loss(x, params, cot):  # arrays as arguments: no weights captured as constants
        out = mp.moe_block(params, x, cfg)
        return jnp.sum(out.y.astype(jnp.float32) * cot.astype(jnp.float32)), out.y

    (_, y), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(jax_shape.x[:n], jax_shape.params,
                                                                 jax_shape.cot[:n])
    return n, np.asarray(jax.device_get(y), np.float32), np.asarray(jax.device_get(dx), np.float32)


class Peer:
    """One shape's torch tensors (copied from the JAX shape's) and timed functions."""

    def __init__(self, jax_shape):
        shape = jax_shape.shape
        self.shape, self.routing = shape, dict(shape.routing)
        p = jax_shape.params
        self.x = to_torch(jax_shape.x).requires_grad_(True)
        self.cot = to_torch(jax_shape.cot)
        self.router = to_torch(p["router"]).float()
        self.bias = to_torch(p["expert_bias"]).float() if "expert_bias" in p else None
        self.w = [to_torch(p[n]).requires_grad_(True) for n in ("wi_gate", "wi_up", "wo")]
        self.compiled = torch.compile(moe_layer)

    def call(self, fn, x, pass_):
        y = fn(x, self.router, *self.w, self.routing, self.shape.k, self.bias)
        if pass_ == "fwd":
            return y
        return torch.autograd.grad((y.float() * self.cot[:x.shape[0]].float()).sum(), [x] + self.w)

    def check(self, ref) -> dict:
        """y and dx of the eager layer on the first n tokens against `ref`
        (reference(jax_shape): moe_block with kernel_backend 'xla' on the same values)."""
        n, y_ref, dx_ref = ref
        x = self.x.detach()[:n].clone().requires_grad_(True)
        y = moe_layer(x, self.router, *self.w, self.routing, self.shape.k, self.bias)
        (dx, ) = torch.autograd.grad((y.float() * self.cot[:n].float()).sum(), [x])
        res = {}
        for name, a, b in (("y", y, y_ref), ("dx", dx, dx_ref)):
            a = a.detach().float().cpu().numpy()
            res[name] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        res["ok"] = all(v < CHECK_TOL for v in res.values())
        return res

    def ideal(self, pass_):
        """torch's dense bf16 GEMMs of the expert shapes on T*k rows (3 fwd, 9 fwd+bwd)."""
        s = self.shape
        r = s.t * s.k
        if not hasattr(self, "_ideal"):
            g = torch.Generator(device="cuda").manual_seed(0)

            def rnd(*d):
                return (torch.randn(*d, device="cuda", generator=g) / d[0]**0.5).bfloat16()

            self._ideal = (rnd(r, s.m), rnd(r, s.h), rnd(r, s.h), rnd(r, s.h), rnd(r, s.m),
                           rnd(s.m, s.h), rnd(s.m, s.h), rnd(s.h, s.m))
        a, act, dg, du, dy, wg, wu, wo = self._ideal
        out = [a @ wg, a @ wu, act @ wo]
        if pass_ != "fwd":
            out += [dg @ wg.T, du @ wu.T, dy @ wo.T, a.T @ dg, a.T @ du, act.T @ dy]
        return out


def time_ms(fn, reps: int = 7, target_ms: float = 250.0) -> float:
    """Median ms per call over `reps` batches timed with CUDA events (warmed up first)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    iters = int(max(1, min(50, target_ms / reps / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def rows(jax_shape, load: str, reps: int) -> tuple[list[dict], dict | None]:
    """(rows of METHODS for both passes at `load`, the check or None): the torch layer timed
    on the shape's inputs (the skewed load: x offset and the router as the JAX methods get
    them)."""
    name = jax_shape.name
    why = unavailable()
    if why:
        return [
            dict(shape=name, load=load, pass_=p, method=m, status=f"skipped: {why}")
            for p in lc.PASSES for m in METHODS
        ], None
    try:
        ref = reference(jax_shape) if load == "balanced" else None
        peer = Peer(jax_shape)
        if load == "skewed":
            peer.router = to_torch(jax_shape.skew[0]).float()
            with torch.no_grad():
                peer.x.add_(to_torch(jax_shape.skew[1]).to(peer.x.dtype))
        check = peer.check(ref) if ref is not None else None
    except Exception as ex:  # noqa: BLE001 - the peer failing must not end the JAX run
        why = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}{_where(ex)}"
        print(f"  torch peer at {name} {load}: {why}", flush=True)
        return [
            dict(shape=name, load=load, pass_=p, method=m, status=why) for p in lc.PASSES
            for m in METHODS
        ], None
    out = []
    for pass_ in lc.PASSES:
        fns = {
            "torch": lambda p=pass_: peer.call(moe_layer, peer.x, p),
            "torch compile": lambda p=pass_: peer.call(peer.compiled, peer.x, p),
            "torch ideal": lambda p=pass_: peer.ideal(p),
        }
        for method, fn in fns.items():
            row = dict(shape=name, load=load, pass_=pass_, method=method)
            if check is not None and not check["ok"] and method != "torch ideal":
                row["status"] = f"check failed: {check}"
            else:
                try:
                    torch.cuda.reset_peak_memory_stats()
                    row["ms"] = time_ms(fn, reps=reps)
                    row["peak_bytes"] = torch.cuda.max_memory_allocated()
                    row["status"] = "ok"
                except Exception as ex:  # noqa: BLE001 - reported in the row, not raised
                    row["status"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
            out.append(row)
    del peer
    torch.cuda.empty_cache()
    return out, check


def _where(ex: BaseException) -> str:
    """' (at FILE:LINE in FUNCTION)' of the innermost frame of this repository's benchmarks/
    in ex's traceback: which line of the peer's setup failed ('' where none is)."""
    frames = [f for f in traceback.extract_tb(ex.__traceback__) if "/benchmarks/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    where = Path(f.filename)
    return (f" (at {where.parent.name}/{where.name}:{f.lineno} in {f.name}: "
            f"{(f.line or '').strip()[:120]})")


def x_torch(rows_: list[dict]) -> None:
    """Adds `x_torch` (the faster of 'torch' and 'torch compile', ms / the row's ms) and, on
    the torch rows, `pct_torch_ideal` to the rows of one (shape, load, pass)."""
    by = {r["method"]: r.get("ms") for r in rows_ if r.get("ms")}
    best = min((by[m] for m in ("torch", "torch compile") if m in by), default=None)
    ideal = by.get("torch ideal")
    for r in rows_:
        if not r.get("ms"):
            continue
        if best and r["method"] not in METHODS:
            r["x_torch"] = best / r["ms"]
        if ideal and r["method"] in METHODS:
            r["pct_torch_ideal"] = 100 * ideal / r["ms"]
