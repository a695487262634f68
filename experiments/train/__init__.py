"""The trainer: the run built and checked from its config (``setup``), the step functions and
optimizer (``steps``, ``microbatch``), the loop (``loop``), orbax checkpoints (``checkpoints``),
metrics (``metrics``) and the stop signals (``signals``)."""
