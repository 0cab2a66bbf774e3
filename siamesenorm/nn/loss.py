"""A cross-entropy that never holds the full fp32 logits: OLMo's loss function, computed over chunks of
``chunk_tokens`` tokens, each chunk's fp32 upcast and log-softmax recomputed in backward instead of kept.

OLMo's loss under bf16 autocast keeps, for backward, an fp32 copy of all logits and their fp32 log-softmax
(8 bytes per token and vocabulary entry: 6.6 GB at 8 x 2048 tokens and 50,304 entries, the largest single item of
a 1.3B step's peak). Chunked, backward keeps only the bf16 logits that the model's output already holds, and one
chunk's fp32 tensors exist at a time. The value is OLMo's within fp32 summation order (tested); the gradient
reaches the logits as one tensor (the chunks are views of them, rejoined once by autograd).

Set ``loss_chunk_tokens`` in the config (for example 4096; null: OLMo's loss).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy_loss"]


def _chunk_terms(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, z_loss: bool):
    """One chunk: per-token cross-entropy (0 where ignored) and, if asked, logsumexp^2, both in fp32."""
    logits = logits.float()
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    if not z_loss:
        return ce
    return ce, logits.logsumexp(-1).pow(2)


def chunked_cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                               reduction: str = "mean", compute_z_loss: bool = False,
                               z_loss_multiplier: float = 1e-4,
                               chunk_tokens: int = 4096) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """OLMo's ``cross_entropy_loss`` (same arguments, same (loss, z_loss) result) over ``chunk_tokens`` rows of
    ``logits`` (N, V) at a time, with autocast off inside (the chunk is upcast to fp32 explicitly, as autocast's
    cross-entropy would)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none (got {reduction!r})")
    ce_parts, z_parts = [], []
    with torch.autocast(logits.device.type, enabled=False):
        for chunk, chunk_labels in zip(logits.split(chunk_tokens), labels.split(chunk_tokens)):
            if torch.is_grad_enabled() and chunk.requires_grad:
                out = checkpoint(_chunk_terms, chunk, chunk_labels, ignore_index, compute_z_loss,
                                 use_reentrant=False, preserve_rng_state=False)
            else:
                out = _chunk_terms(chunk, chunk_labels, ignore_index, compute_z_loss)
            ce, z = out if compute_z_loss else (out, None)
            ce_parts.append(ce if reduction == "none" else ce.sum())
            if z is not None:  # as OLMo's: masked where summed or averaged, every token where not reduced
                z_parts.append(z if reduction == "none" else (z * (chunk_labels != ignore_index)).sum())
    if reduction == "none":
        ce = torch.cat(ce_parts)
        z = torch.cat(z_parts) if compute_z_loss else None
    else:
        ce = torch.stack(ce_parts).sum()
        z = torch.stack(z_parts).sum() if compute_z_loss else None
        if reduction == "mean":
            count = (labels != ignore_index).sum()
            ce = ce / count  # as F.cross_entropy's mean: over the tokens not ignored
            z = z / labels.numel() if z is not None else None  # as OLMo's: over every token
    return ce, (z_loss_multiplier * z if z is not None else None)
