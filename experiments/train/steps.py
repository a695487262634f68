"""The jitted step functions: init, train and eval with explicit shardings, and the optimizer.

- The state {step, params, opt_state, non_trainable} is sharded by Praxis's ``WeightHParams``
  split mappings for parameters, the same for the optimizer's moments; the batch is split over
  every token axis (dp, fsdp, ep).
- A train step: loss = TransformerLm's ``total_loss`` = mean next-byte cross-entropy + every aux
  loss the layers registered (``mutable=[aux_loss, summaries, non_trainable]``), global-norm
  clipping, AdamW. The NON_TRAINABLE collection the forward pass updated (``update_var``: the
  MoE layers' expert bias, DeepSeek-V3's rule on the step's global token counts) replaces the
  state's, once per optimizer step and outside the gradient; eval steps update nothing. Its
  metrics add the MoE layers' router entropy, dropped-token fraction and z-loss (means over the
  layers) and the expert load. With ``train.on_nonfinite='skip'`` a step whose loss or gradient
  norm is not finite returns the state it was given (step + 1) and ``skipped=1`` in its metrics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

import moe_praxis  # Praxis shims before praxis is imported
from praxis import base_layer, py_utils

from configs import base, models, stack
from experiments.train import microbatch
from experiments.train.metrics import (expert_load, max_mean_load, moe_scalars,
                                       router_entropy_by_layer)
from experiments.train.setup import Prepared

P = jax.sharding.PartitionSpec
NestedMap = py_utils.NestedMap
MUTABLE = [base_layer.AUX_LOSS, base_layer.SUMMARIES, base_layer.NON_TRAINABLE]
XENT_EPS = 1e-6  # Praxis's avg_xent = total_xent / (total_weight + 1e-6)


def _model_inputs(batch):
    ids = batch["ids"]
    paddings = jnp.zeros(ids.shape, jnp.float32)
    labels = NestedMap(class_ids=batch["labels"], class_weights=batch["weights"])
    return ids, paddings, labels


def fp8_layers(model_config):
    """(fprop dtype, kernel backend, layer config) of the model's MoE layers with fp8 set, or
    None when none has: the train step then asks for their weights' FP8 form once
    (moe_praxis.step_fp8_weights), made where it pays. The layer config is the
    first FP8 layer's as the stack makes it (num_experts set)."""
    found = [c for _, c in stack.moe_layer_configs(model_config) if c.fp8]
    if not found:
        return None
    c = found[0]
    return _fprop_dtype(c, model_config), c.kernel_backend, c


def _fprop_dtype(layer, model_config):
    # a layer's fprop_dtype left unset is its parent's (Praxis copies it down at build)
    return layer.fprop_dtype or model_config.fprop_dtype


def moe_fprop_dtype(model_config):
    """The fprop dtype of the model's MoE layers (the first one's), None without one."""
    found = [c for _, c in stack.moe_layer_configs(model_config)]
    return jnp.dtype(_fprop_dtype(found[0], model_config)) if found else None


def _segments(batch) -> dict:
    """data.packing='documents': Praxis's segment_ids / segment_pos (attention and rotary
    positions inside each packed document)."""
    return {k: batch[k] for k in ("segment_ids", "segment_pos") if k in batch}


def make_optimizer(opt: base.OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) -> AdamW(schedule), its first moment kept in
    ``mu_dtype``. Returns (transformation, schedule)."""
    decay = opt.decay_steps or num_steps
    lr, w = opt.learning_rate, opt.warmup_steps
    if opt.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, max(decay - w, 1), alpha=opt.end_lr_fraction)
    else:
        after = optax.linear_schedule(lr, lr * opt.end_lr_fraction, max(decay - w, 1))
    # Linear warmup from 0 over w steps, then the decay over the remaining decay - w steps.
    sched = after if w == 0 else optax.join_schedules([optax.linear_schedule(0.0, lr, w), after],
                                                      [w])
    chain = [optax.clip_by_global_norm(opt.clip_norm)] if opt.clip_norm > 0 else []
    chain.append(
        _first_moment_kept_in(
            optax.adamw(sched, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay),
            jnp.dtype(opt.mu_dtype)))
    return optax.chain(*chain), sched


def _first_moment_kept_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``tx`` (an AdamW) with its first moment ``mu`` stored in ``dtype`` and upcast to float32
    for each update, so the moving average runs in float32. optax's own ``mu_dtype`` computes
    ``b1 * mu`` in the stored dtype, where bfloat16 rounds b1 = 0.9 to 0.8984: its moment of a
    constant gradient settles at 0.984 of it."""
    if dtype == jnp.float32:
        return tx

    def cast(state, to):
        mu = optax.tree_utils.tree_get(state, "mu")
        return optax.tree_utils.tree_set(state, mu=jax.tree.map(lambda m: m.astype(to), mu))

    def update(updates, state, params=None):
        updates, state = tx.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(tx.init(params), dtype), update)


@dataclasses.dataclass
class StepFns:
    init: Any
    train: Any
    eval: Any
    state_sharding: Any
    batch_sharding: Any
    abstract_state: Any
    schedule: Any


def make_step_fns(prep: Prepared) -> StepFns:
    """Jitted init / train / eval with explicit shardings (nothing is compiled yet)."""
    exp, model, mesh = prep.config, prep.model, prep.mesh
    nl = models.num_layers(prep.model_config)
    lpb = models.stack_block(prep.model_config).num_layers
    first_repeated = models.first_repeated_layer(prep.model_config)
    tx, schedule = make_optimizer(exp.optimizer, exp.train.num_steps)
    skip_nonfinite = exp.train.on_nonfinite == "skip"
    b, s = exp.data.batch_size, exp.data.seq_len
    # The batch is split over the token axes exactly as the MoE block splits its tokens.
    token_axes = exp.mesh.resources.token_axes
    batch_spec = P(token_axes if token_axes else None, None)
    batch_sharding = jax.sharding.NamedSharding(mesh, batch_spec)
    fake = {
        "ids": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "labels": jax.ShapeDtypeStruct((b, s), jnp.int32),
        "weights": jax.ShapeDtypeStruct((b, s), jnp.float32)
    }
    if exp.data.packing == "documents":
        fake.update(
            {k: jax.ShapeDtypeStruct((b, s), jnp.int32)
             for k in ("segment_ids", "segment_pos")})

    def init_fn(key):
        ids, paddings, labels = _model_inputs({
            k: jnp.zeros(v.shape, v.dtype)
            for k, v in fake.items()
        })
        k1, k2 = jax.random.split(key)
        variables = model.init({
            base_layer.PARAMS: k1,
            base_layer.RANDOM: k2
        },
                               ids,
                               paddings,
                               labels=labels)
        params = variables[base_layer.PARAMS]
        rest = {k: v for k, v in variables.items() if k == base_layer.NON_TRAINABLE}
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "non_trainable": rest
        }

    # Shardings: Praxis's WeightHParams split mappings when the model has a mesh, else
    # replicated parameters.
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init_fn, jax.random.key(0))
    if getattr(model, "ici_mesh_shape", None) is not None:
        ids, paddings, labels = _model_inputs(fake)
        with jax.set_mesh(mesh):
            var_hparams = model.abstract_init_with_metadata(ids, paddings, labels=labels)
        specs = base_layer.var_partition_specs(var_hparams,
                                               mesh_shape=model.ici_mesh_shape,
                                               device_axis_names=model.mesh_axis_names)
        param_specs = specs[base_layer.PARAMS]
        nt_specs = {k: specs[k] for k in abstract["non_trainable"]}
    else:
        param_specs = jax.tree_util.tree_map(lambda _: P(), abstract["params"])
        nt_specs = jax.tree_util.tree_map(lambda _: P(), abstract["non_trainable"])
    opt_specs = optax.tree_map_params(tx,
                                      lambda _, spec: spec,
                                      abstract["opt_state"],
                                      param_specs,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda x: isinstance(x, P))
    specs = {"step": P(), "params": param_specs, "opt_state": opt_specs, "non_trainable": nt_specs}
    state_sharding = jax.tree_util.tree_map(lambda sp: jax.sharding.NamedSharding(mesh, sp),
                                            specs,
                                            is_leaf=lambda x: isinstance(x, P))
    replicated = jax.sharding.NamedSharding(mesh, P())

    fp8_moe = fp8_layers(prep.model_config)
    cast_dtype = moe_fprop_dtype(prep.model_config) if exp.train.cast_weights_once else None
    if cast_dtype == jnp.float32:
        cast_dtype = None
    # train.grad_accum_steps: micro-batches [B/n, S] over the token axes like the batch
    n_micro = exp.train.grad_accum_steps
    shards = math.prod(mesh.shape[a] for a in token_axes)
    micro_sharding = jax.sharding.NamedSharding(mesh, P(None, *batch_spec))
    bias_rule = microbatch.bias_rule(prep.model_config) if n_micro > 1 else None

    def fp8_form(params, batch):
        """The FP8 form of the expert weights, made once per step (None: no FP8 layer, or too
        few rows per expert in the step for it to pay)."""
        if fp8_moe is None:
            return None
        dtype, _, layer = fp8_moe
        form = moe_praxis.step_fp8_weights(params, layer, mesh, math.prod(batch["ids"].shape),
                                           dtype)
        return form if form.pays else None

    def loss_fn(params, non_trainable, batch, key, do_eval, fp8_tree=None):
        ids, paddings, labels = _model_inputs(batch)
        ctx = base_layer.JaxContext.HParams(do_eval=do_eval)
        if cast_dtype is not None:  # train.cast_weights_once
            params = moe_praxis.cast_expert_weights(params, cast_dtype)
        if fp8_tree:
            params = fp8_tree.merged(params)
        with base_layer.JaxContext.new_context(hparams=ctx):
            out, updated = model.apply({
                base_layer.PARAMS: params,
                **non_trainable
            },
                                       ids,
                                       paddings,
                                       labels=labels,
                                       **_segments(batch),
                                       rngs={base_layer.RANDOM: key},
                                       mutable=MUTABLE)
        return out.total_loss, (out, updated)

    def whole_step(state, batch, key, fp8_tree):
        """One forward and backward over the whole batch: (grads, loss metrics, the
        non-trainable collections the forward updated, summaries)."""
        (loss, (out, updated)), grads = jax.value_and_grad(loss_fn,
                                                           has_aux=True)(state["params"],
                                                                         state["non_trainable"],
                                                                         batch, key, False,
                                                                         fp8_tree)
        nt = {k: updated.get(k, v) for k, v in state["non_trainable"].items()}
        losses = {
            "loss": loss,
            "xent": out.avg_xent,
            "aux_loss": out.get("aux_loss", jnp.zeros(()))
        }
        return grads, losses, nt, updated.get(base_layer.SUMMARIES, {})

    def micro_steps(state, batch, key, fp8_tree):
        """whole_step's results over ``n_micro`` micro-batches (experiments.train.microbatch), each
        seeing the step's state and FP8 weights. The cross-entropy is summed with the whole
        step's weights (a mean over its tokens, not a mean of micro-batch means); the rest of
        total_loss (the aux losses), the summaries and the metrics are means over the
        micro-batches; the expert bias moves once, on the step's summed token counts."""
        nt0 = state["non_trainable"]
        total_weight = jnp.sum(batch["weights"], dtype=jnp.float32)
        micro = jax.lax.with_sharding_constraint(microbatch.split(batch, n_micro, shards),
                                                 micro_sharding)

        def objective(params, mb, k):
            _, (out, updated) = loss_fn(params, nt0, mb, k, False, fp8_tree)
            xent = out.total_xent / (total_weight + XENT_EPS)
            summaries = updated.get(base_layer.SUMMARIES, {})
            sums = {"xent": xent, "aux_loss": out.get("aux_loss", jnp.zeros(())) / n_micro}
            if bias_rule is not None and base_layer.NON_TRAINABLE in nt0:
                sums["counts"] = microbatch.expert_counts(nt0[base_layer.NON_TRAINABLE], summaries)
            per_micro = {
                "summaries": summaries,
                "nt": {
                    c: updated.get(c, v)
                    for c, v in nt0.items()
                }
            }
            return xent + (out.total_loss - out.avg_xent) / n_micro, (sums, per_micro)

        grads, loss, sums, per_micro = microbatch.accumulate(
            jax.value_and_grad(objective, has_aux=True), state["params"], micro, key,
            state_sharding["params"])
        nt = jax.tree.map(lambda x: x[-1], per_micro["nt"])
        if "counts" in sums:
            nt[base_layer.NON_TRAINABLE] = microbatch.update_biases(nt0[base_layer.NON_TRAINABLE],
                                                                    sums["counts"], bias_rule)
        summaries = jax.tree.map(lambda x: jnp.mean(x, 0), per_micro["summaries"])
        return grads, {
            "loss": loss,
            "xent": sums["xent"],
            "aux_loss": sums["aux_loss"]
        }, nt, summaries

    def train_fn(state, batch):
        step = state["step"]
        key = jax.random.fold_in(jax.random.key(exp.train.seed + 1), step)
        fp8_tree = fp8_form(state["params"], batch)  # once per optimizer step
        run = whole_step if n_micro == 1 else micro_steps
        grads, losses, nt, summaries = run(state, batch, key, fp8_tree)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.global_norm(grads)
        loss = losses["loss"]
        metrics = {**losses, "grad_norm": grad_norm, "learning_rate": schedule(step)}
        if skip_nonfinite:
            # Not optax.apply_if_finite: it looks at the gradients only, adds counters to the
            # optimizer state (so the two policies' checkpoints would not be interchangeable)
            # and applies the update anyway after its limit; the loop stops instead.
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            params, opt_state, nt = jax.tree_util.tree_map(
                lambda new, old: jnp.where(finite, new, old), (params, opt_state, nt),
                (state["params"], state["opt_state"], state["non_trainable"]))
            metrics["skipped"] = jnp.where(finite, 0.0, 1.0)
        metrics.update(moe_scalars(summaries))
        load = expert_load(summaries, nl, lpb, first_repeated)
        if load is not None:
            metrics["expert_load"] = load
            metrics["max_mean_load"] = max_mean_load(load)
        entropy = router_entropy_by_layer(summaries, nl, lpb, first_repeated)
        if entropy is not None:
            metrics["router_entropy_by_layer"] = entropy
        new_state = {
            "step": step + 1,
            "params": params,
            "opt_state": opt_state,
            "non_trainable": nt
        }
        return new_state, metrics

    def eval_fn(state, batch):
        loss, (out, _) = loss_fn(state["params"], state["non_trainable"], batch, jax.random.key(0),
                                 True)
        return {"xent": out.avg_xent}

    init = jax.jit(init_fn, out_shardings=state_sharding)
    train = jax.jit(train_fn,
                    in_shardings=(state_sharding, batch_sharding),
                    out_shardings=(state_sharding, replicated),
                    donate_argnums=0)
    evaluate = jax.jit(eval_fn,
                       in_shardings=(state_sharding, batch_sharding),
                       out_shardings=replicated)
    abstract_state = jax.tree_util.tree_map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, state_sharding)
    return StepFns(init=init,
                   train=train,
                   eval=evaluate,
                   state_sharding=state_sharding,
                   batch_sharding=batch_sharding,
                   abstract_state=abstract_state,
                   schedule=schedule)


def put_batch(batch: dict, sharding) -> dict:
    """Global numpy batch -> global jax arrays; each process fills only its own shards (the
    host-only ``label_bytes`` stays behind)."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items() if k != "label_bytes"
    }
