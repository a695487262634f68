"""Test setup: 8 host devices for multi-device tests (set before JAX is imported) and the
`gpu` marker, skipped where no CUDA GPU is visible. Under pytest-xdist (`-n N`) the workers share
one GPU, so none preallocates 75% of its memory (XLA_PYTHON_CLIENT_PREALLOCATE=false unless
set): with preallocation, 8 workers on one H100 failed every GPU test they ran."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to JAX here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
