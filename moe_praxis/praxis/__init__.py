"""The Praxis side of moe_praxis: a thin BaseLayer over ``moe_block`` and what it needs.

  compat.py    Praxis 1.4.0 on current JAX (applied by ``import moe_praxis``; imports no praxis)
  layer.py     MoEFeedForward, the Praxis layer (imports praxis)
  gshard.py    GShard's parameter names, capacity rule and checkpoint converter (no praxis)
  sharding.py  the layer's weight sharding checked against EPLayout.weight_specs (no praxis)
  stack.py     DenseFirstRepeated: k dense layers, then a scanned repeated stack (imports praxis)

This package's ``__init__`` imports nothing, so ``import moe_praxis`` (which applies the
compat shims from here) does not import praxis; ``moe_praxis.MoEFeedForward`` loads ``layer``
on first access (``convert_gshard_params`` imports no praxis and is imported eagerly).
"""
