"""PyTorch stand-ins for the five Triton kernels OLMo-core's MoE layers permute tokens with, so that OLMo-core's own
MoE (its router, auxiliary losses, expert MLPs and autograd functions, all unchanged) runs where Triton does not:
on CPU, in CI and in the tests. ``install()`` puts them in place only when OLMo-core found no Triton kernels
(``olmo_core.ops.moe.kernels is None``); on a GPU machine with Triton nothing here is used.

The contract, read from ``olmo_core.ops.moe`` (MegaBlocks' layout): a token's ``top_k`` choices are flattened to
``T * top_k`` slots, slot ``s`` belongs to token ``s // top_k``; ``indices`` lists the slots sorted by expert,
``bins`` is the inclusive cumulative count of slots per expert (expert ``e`` owns ``indices[bins[e-1]:bins[e]]``),
and ``weights`` (optional) is the router's weight per slot. ``gather``/``scatter`` move rows between tokens and the
expert-sorted order with no padding; the ``binned_`` forms use a (experts, capacity, d) buffer and drop the slots an
expert receives beyond its capacity (their rows stay zero). ``*_wgrad`` is the gradient of a scatter with respect
to ``weights``: for each slot, the dot product of the expert's output row with the incoming gradient of its token.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Tuple

import torch

__all__ = ["gather", "scatter", "scatter_wgrad", "binned_gather", "binned_scatter", "binned_scatter_wgrad",
           "install"]


def _scaled(rows: torch.Tensor, slots: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    if weights is None:
        return rows
    return (rows.float() * weights[slots].float().unsqueeze(-1)).to(rows.dtype)


def _sum_choices(flat: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T * top_k, d) slot rows -> (T, d), each token's rows summed."""
    return flat.view(-1, top_k, flat.shape[-1]).sum(dim=1)


def _kept(indices: torch.Tensor, bins: torch.Tensor, capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each position of ``indices`` within an expert's capacity: its position and its (expert, entry) row of
    the binned buffer, flattened to expert * capacity + entry."""
    position = torch.arange(indices.shape[0], device=indices.device)
    counts = torch.diff(bins.long(), prepend=bins.new_zeros(1).long())
    expert = torch.repeat_interleave(torch.arange(bins.shape[0], device=bins.device), counts)
    start = bins.long() - counts
    entry = position - start[expert]
    keep = entry < capacity
    return position[keep], expert[keep] * capacity + entry[keep]


def gather(x, indices, bin_ids, weights, bins, top_k):
    """Token rows (T, d) -> slot rows in expert order (T * top_k, d)."""
    del bin_ids, bins
    return _scaled(x[indices.long() // top_k], indices.long(), weights)


def scatter(x, indices, bin_ids, weights, bins, top_k):
    """Slot rows in expert order (T * top_k, d) -> token rows (T, d), each token's choices summed."""
    del bin_ids, bins
    slots = indices.long()
    flat = x.new_zeros((indices.shape[0], x.shape[-1]))
    flat[slots] = _scaled(x, slots, weights)
    return _sum_choices(flat, top_k)


def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k):
    del bin_ids, bins
    slots = indices.long()
    out = x.new_zeros(indices.shape[0])
    out[slots] = (x.float() * grad[slots // top_k].float()).sum(-1).to(x.dtype)
    return out


def binned_gather(x, indices, weights, bins, capacity, top_k):
    """Token rows (T, d) -> (experts, capacity, d); slots past an expert's capacity are dropped."""
    position, row = _kept(indices, bins, capacity)
    slots = indices.long()[position]
    out = x.new_zeros((bins.shape[0] * capacity, x.shape[-1]))
    out[row] = _scaled(x[slots // top_k], slots, weights)
    return out.view(bins.shape[0], capacity, x.shape[-1])


def binned_scatter(x, indices, weights, bins, top_k):
    """(experts, capacity, d) -> token rows (T, d), each token's kept choices summed."""
    experts, capacity, width = x.shape
    position, row = _kept(indices, bins, capacity)
    slots = indices.long()[position]
    flat = x.new_zeros((indices.shape[0], width))
    flat[slots] = _scaled(x.reshape(experts * capacity, width)[row], slots, weights)
    return _sum_choices(flat, top_k)


def binned_scatter_wgrad(x, grad, indices, bins, top_k):
    experts, capacity, width = x.shape
    position, row = _kept(indices, bins, capacity)
    slots = indices.long()[position]
    out = x.new_zeros(indices.shape[0])
    out[slots] = (x.reshape(experts * capacity, width)[row].float() * grad[slots // top_k].float()).sum(-1).to(
        x.dtype)
    return out


def install() -> bool:
    """Use these kernels in OLMo-core's MoE ops if it has none (no Triton); True if they are in use."""
    from olmo_core.ops import moe as ops

    if getattr(ops, "kernels", None) is None:
        ops.kernels = SimpleNamespace(**{name: globals()[name] for name in __all__ if name != "install"})
    return isinstance(ops.kernels, SimpleNamespace)
