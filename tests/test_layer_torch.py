"""benchmarks/layer_torch.py (the PyTorch peer of benchmarks.layer) on the CPU: its layer
against moe_block at every --quick shape (where torch is importable: the GPU machine has it,
CI does not), and the place its failures name."""

import jax
import pytest

from benchmarks import layer, layer_cases as lc, layer_torch as lt


def test_a_failure_names_the_peers_line():
    try:
        lt.reference(None)  # no shape: fails inside reference()
    except AttributeError as ex:
        where = lt._where(ex)
    assert where.startswith(" (at benchmarks/layer_torch.py:") and "in reference: " in where
    assert lt._where(ValueError("raised nowhere")) == ""


@pytest.mark.parametrize("name", sorted(lc.QUICK_SHAPES))
def test_the_peer_equals_moe_block(name, monkeypatch):
    """y and dx of the TorchTitan-style layer (float32 router, stable sort, torch._grouped_mm,
    index_add_) within the benchmark's own bound (CHECK_TOL, relative norm, bf16) of moe_block
    with kernel_backend 'xla' on the same inputs: softmax top-k and DeepSeek-V3's grouped
    sigmoid routing with the expert bias."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    monkeypatch.setattr(lt, "to_torch",
                        lambda a: torch.from_dlpack(jax.device_put(a,
                                                                   jax.devices()[0])).clone())
    monkeypatch.setattr(torch, "compile", lambda f: f)
    sh = layer.Shape(name, lc.QUICK_SHAPES[name], ["cuda"], "xla", jax.random.key(0))
    check = lt.Peer(sh).check(lt.reference(sh))
    assert check["ok"] and 0 < check["y"] < lt.CHECK_TOL and 0 < check["dx"] < lt.CHECK_TOL, check
