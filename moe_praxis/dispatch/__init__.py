"""Dispatch: token copies to their experts and back, in three stages.

  capacity.py  which copies each expert keeps (capacity_factor, drop_policy), equal to the
               single-device choice on any mesh
  sort.py      the kept copies sorted by expert (Dispatch), the combine back into tokens
  exchange.py  under expert parallelism, the rows to their experts' EP rank and back
               ('padded' all_to_all or 'ragged' ragged_all_to_all), regrouped by local expert

Letters: T tokens, k top_k, E experts, R = T*k rows (one per token copy), M d_model.
"""

from moe_praxis.dispatch.capacity import capacity_keep, global_keep
from moe_praxis.dispatch.sort import (Dispatch, combine_rows, combine_sorted, dispatch_rows,
                                      row_weights, sort_copies)

__all__ = [
    "Dispatch",
    "capacity_keep",
    "combine_rows",
    "combine_sorted",
    "dispatch_rows",
    "global_keep",
    "row_weights",
    "sort_copies",
]
