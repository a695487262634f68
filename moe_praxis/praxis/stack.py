"""DenseFirstRepeated: k dense layers, then a repeated (scanned) stack of MoE blocks.

DeepSeek-V3's ``first_k_dense_replace``: its first 3 layers have a dense FFN, the other 58 are
MoE. Praxis's ``StackedTransformer.moe_layers`` expresses that only in an unrolled stack (one
trace per layer); ``StackedTransformerRepeated`` scans one block, so every layer is alike.
This stack is both: ``first_k_dense`` layers that are ``block`` with no MoE layer (the same
attention, norms, dense FFN of ``block.hidden_dims`` and sharding), then ``x_times`` scanned
repeats of ``block``. It is a ``StackedTransformerRepeated``, so ``TransformerLm`` (setup and
``set_sharding_params_v1``) configures its ``block`` as it does the plain repeated stack's, and
the dense layers are cloned from that block at setup.

Variables: the dense layers under ``dense/x_layers_{i}`` (i < first_k_dense), the repeats
under ``repeat/sub/...`` with a leading [x_times] dimension; layer l >= first_k_dense is
repeat (l - first_k_dense) // block.num_layers.

Decoding (``extend_step`` and the decode-state transforms of Praxis's sampling loops) runs the
dense layers, then the repeats, each with its own attention caches (``DECODE_CACHE`` under
``dense/...`` and ``repeat/...``).
"""

from __future__ import annotations

from typing import Optional

from praxis import base_layer
from praxis.layers import transformers

JTensor = base_layer.JTensor


class DenseFirstRepeated(transformers.StackedTransformerRepeated):
    """``first_k_dense`` dense layers, then ``x_times`` repeats of ``block`` (scanned).

    Attributes:
      first_k_dense: dense layers before the repeats (0 = the plain repeated stack).
    """

    first_k_dense: int = 0

    def setup(self) -> None:
        k = self.first_k_dense
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"DenseFirstRepeated {self.name!r}: first_k_dense={k!r} is invalid: "
                             "must be an int >= 0")
        super().setup()
        if k:
            dense = self.block.clone()
            dense.num_layers = k
            dense.moe_layers = []
            self.create_child("dense", dense)

    def __call__(self,
                 inputs: JTensor,
                 paddings: JTensor,
                 segment_mask: Optional[JTensor] = None,
                 cross_inputs: Optional[JTensor] = None,
                 cross_paddings: Optional[JTensor] = None,
                 cross_segment_mask: Optional[JTensor] = None,
                 segment_pos: Optional[JTensor] = None) -> JTensor:
        """inputs [B, T, M], paddings [B, T] -> [B, T, M]: the dense layers, then the
        repeats (arguments as StackedTransformerRepeated's)."""
        if self.first_k_dense:
            inputs = self.dense(inputs,
                                paddings,
                                segment_mask=segment_mask,
                                cross_inputs=cross_inputs,
                                cross_paddings=cross_paddings,
                                cross_segment_mask=cross_segment_mask,
                                segment_pos=segment_pos)
        return super().__call__(inputs, paddings, segment_mask, cross_inputs, cross_paddings,
                                cross_segment_mask, segment_pos)

    def extend_step(self,
                    inputs: JTensor,
                    *,
                    time_step: JTensor,
                    segment_pos: Optional[JTensor] = None,
                    atten_mask: Optional[JTensor] = None,
                    cross_paddings: Optional[JTensor] = None,
                    cross_segment_mask: Optional[JTensor] = None) -> JTensor:
        """Cached decoding of one step ([B, M]) or of L steps ([B, L, M]): the dense layers'
        extend_step, then the repeats' (arguments as StackedTransformerRepeated's)."""
        kw = dict(time_step=time_step,
                  segment_pos=segment_pos,
                  atten_mask=atten_mask,
                  cross_paddings=cross_paddings,
                  cross_segment_mask=cross_segment_mask)
        if self.first_k_dense:
            inputs = self.dense.extend_step(inputs, **kw)
        return super().extend_step(inputs, **kw)

    # The decode-state transforms of the sampling loops reach the dense layers' caches too.
    def transform_decode_state(self, transform_fn: base_layer.DecodeStateTransformFn) -> None:
        if self.first_k_dense:
            self.dense.transform_decode_state(transform_fn)
        super().transform_decode_state(transform_fn)

    def lazy_broadcast_prefix(self, num_suffix_samples: int, suffix_length: int) -> None:
        if self.first_k_dense:
            self.dense.lazy_broadcast_prefix(num_suffix_samples, suffix_length)
        super().lazy_broadcast_prefix(num_suffix_samples, suffix_length)

    def right_align_decode_state_with_prefix(
            self, max_prefix_size: int, right_align_fn: base_layer.DecodeStateTransformFn) -> None:
        if self.first_k_dense:
            self.dense.right_align_decode_state_with_prefix(max_prefix_size, right_align_fn)
        super().right_align_decode_state_with_prefix(max_prefix_size, right_align_fn)
