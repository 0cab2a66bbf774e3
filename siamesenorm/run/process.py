"""The process a run lives in, the same for both frameworks: CPU threads, and how many graphs compiled blocks may
specialise to.

On a CPU without OMP_NUM_THREADS set, a run takes one intra-op thread: the small models trained on CPUs here ran
far slower with more (the ai2-olmo path measured 2 threads against 1 on 2 cores, docs/training.md; OLMo-core's
environment set-up would otherwise set OMP_NUM_THREADS=8, whatever the machine has). A value the user set is kept.
"""

from __future__ import annotations

import os

import torch

__all__ = ["pin_cpu_threads", "allow_recompiles"]

_COMPILED_BLOCKS = 0  # blocks this process has compiled so far (allow_recompiles)


def pin_cpu_threads() -> int:
    """One intra-op thread on a CPU-only machine unless OMP_NUM_THREADS is set (then that); returns the count.
    Call it before a framework's environment set-up, which may set OMP_NUM_THREADS itself."""
    if torch.cuda.is_available():
        return torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # OLMo-core's set-up keeps a value that is already there
        torch.set_num_threads(1)
    return torch.get_num_threads()


def allow_recompiles(blocks: int) -> int:
    """Raise dynamo's per-code-object recompile limit (8 by default) before ``blocks`` more blocks are compiled.

    Every block of every variant runs one ``forward`` code object, and dynamo specialises it per block on what
    differs (the first and last block, a layer's source count in AttnRes, another variant's flags); with
    ``fullgraph=True`` the ninth specialisation is a hard error (seen on an H200 with torch 2.11, timing five
    variants in one process). Allows two graphs a block compiled in this process, and at least the default; returns
    the limit now set."""
    import torch._dynamo

    global _COMPILED_BLOCKS
    _COMPILED_BLOCKS += blocks
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    limit = max(getattr(config, name), 8 + 2 * _COMPILED_BLOCKS)
    setattr(config, name, limit)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * limit)
    return limit
