# Sourced by the device run scripts (benchmarks/*_device_run.sh): what every GPU call records
# and needs before it times anything.
#   device_env FILE      the date, nvidia-smi's GPU line and jax's versions and devices, to FILE
#                        and stdout
#   ensure_library DIR   load the carried kernel library or build it (its log in DIR/build.log,
#                        the library gzipped as DIR/libmoe_praxis_kernels.so.gz: carried in .whl/,
#                        benchmarks/device_carry.sh puts it back for later calls)
#   library_file         the path the loader reads the kernel library from (the library layer's)

device_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv
    python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  } > "$1" 2>&1
  cat "$1"
}

ensure_library() {
  if ! python3 -c "from moe_praxis.ops import backend; ok, why = backend.load_library(); print(why); raise SystemExit(0 if ok else 1)" 2>&1; then
    echo "carried library not loadable: building here"
    python3 -m moe_praxis.build_kernels --jobs 16 2>&1 | tee "$1/build.log"
    gzip -c "$(library_file)" > "$1/libmoe_praxis_kernels.so.gz"
  fi
}

library_file() {
  python3 -c "from moe_praxis.ops._library import library_path; print(library_path())"
}
