"""How far from 1 the column sums of mHC's Sinkhorn output stay after k iterations, by where the logits start
(each iteration normalises columns, then rows, so rows end exact and the columns carry the error).

Prints one line per (start, noise, iterations): the worst |column sum - 1| over 2,000 random n x n matrices whose
logits are the start's bias plus Gaussian noise of the given size. The start is a target diagonal value p of
exp(logits) normalised; p = 1/n is the uniform start mhc uses.

    python scripts/sinkhorn_convergence.py [--n 4]
"""

import argparse
import math


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="streams (mhc_expansion_rate)")
    args = parser.parse_args(argv)
    import torch  # after --help

    from siamesenorm.nn import sinkhorn

    n = args.n
    torch.manual_seed(0)
    print("diagonal_start  noise  iterations  max|column_sum-1|  (rows end exact: the paper's T_r(T_c(.)))")
    for p in (0.95, 0.8, 0.5, 1.0 / n):
        diag = math.log(p / (1 - p) * (n - 1))
        for noise in (0.1, 0.3, 1.0):
            logits = noise * torch.randn(2000, n, n)
            logits.diagonal(dim1=-2, dim2=-1).add_(diag)
            for iterations in (5, 20, 50):
                err = (sinkhorn(logits, iterations).sum(-2) - 1).abs().max().item()
                print(f"{p:14.3f}  {noise:5.1f}  {iterations:10d}  {err:.2e}")
    return 0
