"""The process a run lives in, the same for both frameworks: CPU threads.

On a CPU without OMP_NUM_THREADS set, a run takes one intra-op thread: the small models trained on CPUs here ran
far slower with more (the ai2-olmo path measured 2 threads against 1 on 2 cores, docs/training.md; OLMo-core's
environment set-up would otherwise set OMP_NUM_THREADS=8, whatever the machine has). A value the user set is kept.
"""

from __future__ import annotations

import os

import torch

__all__ = ["pin_cpu_threads"]


def pin_cpu_threads() -> int:
    """One intra-op thread on a CPU-only machine unless OMP_NUM_THREADS is set (then that); returns the count.
    Call it before a framework's environment set-up, which may set OMP_NUM_THREADS itself."""
    if torch.cuda.is_available():
        return torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # OLMo-core's set-up keeps a value that is already there
        torch.set_num_threads(1)
    return torch.get_num_threads()
