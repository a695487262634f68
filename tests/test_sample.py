"""experiments.sample on the three preset families at small sizes (CPU, float32).

One job per family (initialised parameters, tests/sample_util.py; the Qwen3 one trained with
capacity factor 0.5), prompts of different lengths in one batch (fresh random bytes):
- greedy with the KV cache == greedy with the whole sequence recomputed, token for token, for 32
  new tokens, with no MoE token copy dropped;
- the logits each cached step chose from == the full forward's at that position: 1e-4 relative
  (float32: the same arithmetic over a masked cache instead of a causal mask, measured ~1e-6),
  and == the plain forward of each prompt alone (no left padding: positions and masks right);
- each reported log-probability == the documented distribution of those logits at the token;
- one compile of each function serves other prompt lengths, numbers of new tokens and settings;
- the DeepSeek-V3 family on its 8-device mesh == one device;
- on the Tiny job's 8-device mesh the host dispatches at most ``STEPS_IN_FLIGHT`` steps ahead of
  the devices, with and without the cache (XLA:CPU deadlocked and aborted when it ran ahead).
Every test samples ROWS rows from the shared one-device samplers (a compile per batch size is
the contract, so one size keeps the module to one compile of each function per family).
"""

import jax
import numpy as np
import pytest
from praxis import base_layer

from experiments.sample import decoding
from experiments import sample
from tests import sample_util, testutil

NEW = 32
ROWS = 3  # rows of every batch sampled from the shared one-device samplers


def _prompts(rng, n=ROWS, lo=2, hi=14):
    return [list(rng.integers(32, 127, size=int(rng.integers(lo, hi)))) for _ in range(n)]


def one_device(job, family, **kw):
    shape = (1, ) * len(sample_util.FAMILIES[family].MESH_SHAPE)
    return sample.load_sampler(job, devices=jax.devices()[:1], mesh={"shape": shape}, **kw)


# The Qwen3-MoE family's job trains with capacity factor 0.5: decoding it must be dropless.
TRAINED_WITH = {"qwen3": {"capacity_factor": 0.5}}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """family -> (job directory, its one-device Sampler), made once per module."""
    made = {}

    def get(family):
        if family not in made:
            job = sample_util.make_job(tmp_path_factory.mktemp(family),
                                       family,
                                       seed=testutil.seed() % (1 << 30),
                                       moe_fields=TRAINED_WITH.get(family))
            made[family] = job, one_device(job, family)
        return made[family]

    return get


def full_logits(sampler, seqs):
    """[len(seqs), T, V] logits of the model on each sequence from position 0, right-padded
    to [8, context] (one compile; causal attention and dropless routing leave the earlier
    positions as they are): the plain forward, not the sampler's left-padded one."""
    ids = np.zeros((8, sampler.context), np.int32)
    pad = np.ones((8, sampler.context), np.float32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], pad[i, :len(s)] = s, 0
    if not hasattr(sampler, "_test_forward"):

        def fwd(v, ids, pad):
            ctx = base_layer.JaxContext.HParams(do_eval=True)
            with base_layer.JaxContext.new_context(hparams=ctx):
                return sampler.model.apply(v, ids, pad).logits

        sampler._test_forward = jax.jit(fwd)
    with jax.set_mesh(sampler.mesh):
        out = sampler._test_forward(sampler.variables, ids, pad)
    return np.asarray(out, np.float32)[:len(seqs)]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# How far the KV-cached logits may be from a full recompute's (relative, per row) and their
# log-probs (absolute): float32 rounding, which some positions of a small random model amplify.
# Measured over fresh jobs and prompts (largest seen / 99th percentile): Qwen3-like 1.95e-4 /
# 9.5e-5 over 700 draws (its log-probs 1.49e-4), and a perturbation of every parameter by 1 ulp
# moves its full recompute by as much (up to 2.9e-4); Tiny 3.4e-6 over 75, DeepSeek-like 1.1e-5
# over 60. A wrong cache (a position, a mask, a stale entry) is off by 1e-2 or more.
CACHE_TOL = {"tiny": 1e-4, "deepseek": 1e-4, "qwen3": 5e-4}


@pytest.mark.parametrize("family", ["tiny", "deepseek", "qwen3"])
def test_cached_greedy_equals_full_recompute(jobs, family):
    seed = testutil.seed()
    rng = np.random.default_rng(seed)
    _, sampler = jobs(family)
    prompts = _prompts(rng)
    cached = sampler.sample(prompts, max_new_tokens=NEW, return_logits=True)
    full = sampler.sample(prompts, max_new_tokens=NEW, use_cache=False, return_logits=True)
    assert cached.tokens == full.tokens
    assert all(len(t) == NEW for t in cached.tokens)
    assert len({tuple(t) for t in cached.tokens}) > 1  # not one degenerate continuation
    assert cached.dropped == 0 and full.dropped == 0
    err = testutil.row_errs(cached.logits, full.logits)
    tol = CACHE_TOL[family]
    assert err.max() < tol, f"prompt seed {seed}: {err.max()}"
    want = log_softmax(full.logits)
    for r, toks in enumerate(cached.tokens):
        np.testing.assert_allclose(cached.log_probs[r],
                                   want[r, np.arange(NEW), toks],
                                   atol=tol,
                                   err_msg=f"prompt seed {seed}")
        assert toks == list(np.argmax(full.logits[r], -1))
    # Other prompt lengths, another number of new tokens: nothing compiles again.
    again = sampler.sample(_prompts(rng, lo=1, hi=30), max_new_tokens=NEW // 2 + 3)
    assert all(len(t) == NEW // 2 + 3 for t in again.tokens)
    assert sampler.compiled() == {"prefill_fn": 1, "step_fn": 1, "full_fn": 1, "choose_fn": 1}


def test_left_padding_equals_each_prompt_alone(jobs):
    """The Tiny job: each row's cached logits == the plain forward of that row alone (from
    position 0, no left padding) at the same positions: padding, positions and masks."""
    rng = np.random.default_rng(testutil.seed())
    _, sampler = jobs("tiny")
    prompts = _prompts(rng, lo=1, hi=20)
    out = sampler.sample(prompts, max_new_tokens=NEW, return_logits=True)
    forward = full_logits(sampler, [p + t for p, t in zip(prompts, out.tokens)])
    for r, p in enumerate(prompts):
        want = forward[r, len(p) - 1:len(p) - 1 + NEW]
        err = testutil.row_errs(out.logits[r], want)
        assert err.max() < 1e-4, (r, err.max())


def test_mesh_equals_one_device(jobs):
    """DeepSeek-V3 family on its 8-device mesh (data 2 x fsdp 2 x expert 2: the batch split
    over the token axes, the experts over expert x fsdp) == one device, greedy, 32 tokens;
    3 prompts (padded to 8 rows on the mesh)."""
    rng = np.random.default_rng(testutil.seed())
    job, single = jobs("deepseek")
    prompts = _prompts(rng)
    mesh = sample.load_sampler(job)
    assert dict(zip(mesh.mesh.axis_names, mesh.mesh.devices.shape)) == {
        "data": 2,
        "fsdp": 2,
        "expert": 2
    }
    wi = jax.tree_util.tree_leaves_with_path(mesh.variables)
    sharded = [jax.tree_util.keystr(p) for p, x in wi if "wi_gate_up" in jax.tree_util.keystr(p)]
    assert sharded and all(
        len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
        for p, x in wi if jax.tree_util.keystr(p) in sharded)
    a = mesh.sample(prompts, max_new_tokens=NEW)
    b = single.sample(prompts, max_new_tokens=NEW)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=1e-4)
    assert a.dropped == 0


def test_dropless_whatever_the_training_capacity(jobs):
    """The Qwen3 job trained with capacity factor 0.5 decodes dropless (0 dropped copies, also
    asserted above); the same job at its training capacity drops copies (the count can fail)."""
    rng = np.random.default_rng(testutil.seed())
    job, sampler = jobs("qwen3")
    prompts = _prompts(rng)
    assert sampler.sample(prompts, max_new_tokens=8).dropped == 0
    capped = one_device(job, "qwen3", dropless=False).sample(prompts, max_new_tokens=8)
    assert capped.dropped > 0


def restricted(z, temperature, top_k, top_p):
    """The documented distribution (experiments.sample.sampling), one row at a time, by a loop:
    log q [V] for logits z [V]."""
    x = log_softmax(z.astype(np.float64) / temperature)
    order = np.argsort(-x, kind="stable")[:top_k or len(z)]
    q = np.exp(x[order]) / np.exp(x[order]).sum()
    kept, mass = [], 0.0
    for tok, qi in zip(order, q):
        if top_p < 1 and mass >= top_p:
            break
        kept.append(tok)
        mass += qi
    out = np.full(len(z), -np.inf)
    out[kept] = x[kept] - np.log(np.exp(x[kept]).sum())
    return out


def test_sampling_settings(jobs):
    """Temperature 0 is deterministic and ignores the seed; top-k 1 is greedy at any
    temperature; a fixed seed reproduces a draw and another seed changes it; each reported
    log-probability is the documented restricted distribution of the full forward's logits at
    that position (float32 logits, 1e-4)."""
    rng = np.random.default_rng(testutil.seed())
    _, sampler = jobs("tiny")
    prompts = _prompts(rng)
    n = 16
    greedy = sampler.sample(prompts, max_new_tokens=n)
    assert sampler.sample(prompts, max_new_tokens=n, seed=5).tokens == greedy.tokens
    k1 = sampler.sample(prompts, max_new_tokens=n, temperature=1.7, top_k=1, seed=3)
    assert k1.tokens == greedy.tokens
    np.testing.assert_allclose(k1.log_probs, 0.0, atol=1e-6)  # the only token left
    compiled = []  # choose_fn's compiles after each setting (ROWS rows each)
    for settings in (dict(temperature=0.9, top_k=20,
                          top_p=0.8), dict(temperature=1.3), dict(temperature=1.0, top_p=0.5)):
        a = sampler.sample(prompts[:1], max_new_tokens=n, num_samples=ROWS, seed=11, **settings)
        compiled.append(sampler.compiled()["choose_fn"])
        b = sampler.sample(prompts[:1], max_new_tokens=n, num_samples=ROWS, seed=11, **settings)
        c = sampler.sample(prompts[:1], max_new_tokens=n, num_samples=ROWS, seed=12, **settings)
        assert a.tokens == b.tokens and a.log_probs == b.log_probs
        assert a.tokens != c.tokens
        assert len({tuple(t) for t in a.tokens}) > 1, settings  # the samples differ
        forward = full_logits(sampler, [p + t for p, t in zip(a.prompts, a.tokens)])
        for r, (p, toks) in enumerate(zip(a.prompts, a.tokens)):
            z = forward[r, len(p) - 1:len(p) - 1 + n]
            want = [
                restricted(z[i], settings["temperature"], settings.get("top_k", 0),
                           settings.get("top_p", 1.0))[t] for i, t in enumerate(toks)
            ]
            np.testing.assert_allclose(a.log_probs[r], want, rtol=0, atol=1e-4)
    assert len(set(compiled)) == 1  # settings are arguments, not constants: no recompile


def test_generate_on_eight_devices_equals_one(jobs):
    """generate() (the Tiny job's data-parallel mesh over all 8 devices) returns per prompt
    its samples' texts, and greedily those of the one-device sampler's tokens."""
    job, single = jobs("tiny")
    prompts = ["Hello", "def f(x):\n    return", "a"]
    texts = sample.generate(job, prompts, max_new_tokens=12)
    ids = single.sample([list(p.encode()) for p in prompts], max_new_tokens=12)
    assert texts == [[single.tokenizer.decode(t)] for t in ids.tokens]


def test_the_host_stays_a_few_steps_ahead_of_a_mesh(jobs):
    """The Tiny job on its data-parallel mesh of 8 devices, greedy with and without the cache:
    when a step's forward is dispatched, at most ``decoding.STEPS_IN_FLIGHT`` earlier forwards
    are unfinished. The loop used to queue every step at once; XLA:CPU then deadlocked (a
    program's launch held a pool thread waiting for one of the device's 32 in-flight slots, held
    by queued programs waiting for a thread) and aborted the process after 40 s in a collective
    that some devices never reached."""
    rng = np.random.default_rng(testutil.seed())
    job, _ = jobs("tiny")
    sampler = sample.load_sampler(job)
    assert sampler.mesh.devices.size == 8
    unfinished = []  # per dispatched forward: the earlier forwards not finished then

    def spy(fn):
        outs = []

        def call(*args):
            unfinished.append(sum(not x.is_ready() for x in outs))
            assert unfinished[-1] <= decoding.STEPS_IN_FLIGHT, unfinished
            out = fn(*args)
            outs.append(out[0])
            return out

        call._cache_size = fn._cache_size
        return call

    sampler.step_fn, sampler.full_fn = spy(sampler.step_fn), spy(sampler.full_fn)
    prompts = _prompts(rng)
    cached = sampler.sample(prompts, max_new_tokens=NEW)
    full = sampler.sample(prompts, max_new_tokens=NEW, use_cache=False)
    assert cached.tokens == full.tokens
    assert len(unfinished) == 2 * NEW  # NEW - 1 steps each; the full path's prefill twice


@pytest.mark.parametrize("kw, fix", [
    (dict(temperature=-0.5), "--temperature=-0.5 is invalid: give a finite value >= 0"),
    (dict(top_p=0.0), "--top_p=0.0 is invalid: give a value in (0, 1]"),
    (dict(top_p=1.5), "--top_p=1.5 is invalid"),
    (dict(top_k=-1), "--top_k=-1 is invalid: give an int >= 0"),
    (dict(num_samples=0), "--num_samples=0 is invalid: give an int >= 1"),
    (dict(max_new_tokens=0), "--max_new_tokens=0 is invalid"),
])
def test_bad_settings(kw, fix):
    settings = dict(max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, num_samples=1)
    with pytest.raises(sample.SampleError, match=fix.replace("(", r"\(").replace("[", r"\[")):
        sample.check_settings(**{**settings, **kw})


def test_the_default_new_tokens_are_what_fits():
    """--max_new_tokens unset: the context minus the longest prompt; a prompt filling the
    context is then refused by check_prompts, not given a limit <= 0."""
    assert sample.fitting_new_tokens([[1] * 9], 64) == 55
    assert sample.fitting_new_tokens([[1] * 9, [2] * 20, [3]], 64) == 44
    sample.check_prompts([[1] * 9, [2] * 20], sample.fitting_new_tokens([[1] * 9, [2] * 20], 64),
                         64, 256)
    with pytest.raises(sample.SampleError, match="prompt 1 is 70 tokens: the prompt alone exceeds"):
        sample.check_prompts([[1], [1] * 70], sample.fitting_new_tokens([[1], [1] * 70], 64), 64,
                             256)
    sample.check_settings(max_new_tokens=None, temperature=0.0, top_k=0, top_p=1.0, num_samples=1)


def test_bad_prompts_and_job_dirs(tmp_path):
    with pytest.raises(sample.SampleError, match="prompt 1 is empty"):
        sample.check_prompts([[1], []], 4, 64, 256)
    with pytest.raises(sample.SampleError,
                       match=r"prompt 0 is 60 tokens: with "
                       r"--max_new_tokens=5 that is 65, longer than the model's context of 64 "
                       r"tokens \(data.seq_len\); shorten the prompt or give --max_new_tokens "
                       r"<= 4"):
        sample.check_prompts([[1] * 60], 5, 64, 256)
    with pytest.raises(sample.SampleError, match="outside the vocabulary"):
        sample.check_prompts([[300]], 1, 64, 256)
    # no positive limit fits: how much too long the prompt is, never a limit <= 0
    for n, why in ((580, "alone exceeds the model's context of 64 tokens .* by 516 tokens"),
                   (64, "alone fills the model's context of 64 tokens .* no room for a new token")):
        with pytest.raises(sample.SampleError,
                           match=f"prompt 0 is {n} tokens: the prompt {why}; "
                           "shorten it to at most 63 tokens") as e:
            sample.check_prompts([[1] * n], 64, 64, 256)
        assert "--max_new_tokens <=" not in str(e.value)
    with pytest.raises(sample.SampleError, match="holds no config.json"):
        sample.recorded_config(tmp_path)
    (tmp_path / "config.json").write_text(sample_util.config_json("tiny"))
    with pytest.raises(sample.SampleError, match="holds no checkpoint in .*: train first"):
        sample.recorded_config(tmp_path)
