#!/bin/bash
# What a call on the GPU machine needs and its image lacks: the Python packages below, as wheels
# for its Python 3.12 (the image has jax, flax, optax, orbax, sentencepiece, tokenizers, torch,
# ...; not these), and the kernel library once built there.
#   bash benchmarks/device_carry.sh
#       here, where PyPI is reached: downloads the wheels into .whl/ (about 24 MB; kept out of
#       git through .git/info/exclude). Name .whl in the call's carry.
#   source benchmarks/device_carry.sh install
#       there, first in a call: installs .whl/*.whl into /tmp/site once per machine and puts it
#       on PYTHONPATH; a library carried as .whl/libmoe_praxis_kernels.so.gz (what ensure_library
#       in device_common.sh returns under $OUT after it built one there) is unpacked to where
#       the loader looks, so later calls skip the 3-minute build.
# The versions are setup.cfg's pins where it has one (the one place they live); the rest are
# those packages' own needs that the image lacks.
if [ "${1:-}" = install ]; then
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1 2>/dev/null || exit 1
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .whl/libmoe_praxis_kernels.so.gz ]; then
    source benchmarks/device_common.sh
    LIB=$(library_file) &&
      mkdir -p "$(dirname "$LIB")" && gunzip -c .whl/libmoe_praxis_kernels.so.gz > "$LIB" ||
      return 1 2>/dev/null || exit 1
  fi
  return 0 2>/dev/null || exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
PINNED="praxis lingvo fiddle clu typeguard jax-bitempered-loss tensorboardX grain nvidia-cutlass"
NEEDS="libcst array_record portpicker ml-collections graphviz"
SPECS=$(python3 - $PINNED <<'EOF'
import configparser, re, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = (cfg["options"]["install_requires"] + cfg["moe_praxis.no_deps"]["packages"] +
         cfg["options.extras_require"]["cuda"]).splitlines()
pins = {re.split(r"[<>=!~ ]", l.strip())[0].lower(): l.strip() for l in lines
        if l.strip() and not l.strip().startswith("#")}
missing = [n for n in sys.argv[1:] if n.lower() not in pins]
if missing:
    raise SystemExit(f"device_carry.sh: setup.cfg pins none of {missing}")
print(" ".join(pins[n.lower()] for n in sys.argv[1:]))
EOF
)
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $SPECS $NEEDS
ls .whl
du -sh .whl
