"""The padding contract's argument check and its plain-torch routing pieces (docs/contracts.md), as a public face
for the rest of moebench: `check_mask` (the one error text of an is_padding that does not fit the rows),
`select_desc_torch` (top-k indices in descending order, ties to the lower index), `renormalize_torch` and
`mask_padded_rows_torch` (padded rows: ids -1, weights 0.0). The very objects of kernels._details, re-exported:
`_details` is imported only inside moebench.kernels (tests/test_import_graph.py)."""

from moebench.kernels._details.args import check_mask
from moebench.kernels._details.router_common import mask_padded_rows_torch, renormalize_torch, select_desc_torch

__all__ = ["check_mask", "select_desc_torch", "renormalize_torch", "mask_padded_rows_torch"]
