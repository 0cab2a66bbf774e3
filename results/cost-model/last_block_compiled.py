"""The two-stream variants' last block compiled alone by inductor, at the 1.3B recipe (fused streams on, bf16,
8 x 2048 tokens): its forward + backward bytes with the block's end as it is now (the update and the final fusion
LN^out_X(X + O / c) + LN^out_Y(Y + O) as one stream op) and as it was before 2026-11-27's eleventh session (eager adds
and two RMSNorms, here left to inductor to fuse), against pre's last block. The cost model keeps the first and last
blocks eager; this says how much of the change a compiled run sees.

    python results/cost-model/last_block_compiled.py      # about 4 minutes on a 2-core CPU; output: last_block_compiled.txt
"""

from siamesenorm.perf import costmodel
from siamesenorm.perf.benchmark import BenchSettings, model_config
from siamesenorm.variants import _base

CONFIG = model_config(BenchSettings(recipe="configs/OLMo-1B-2e-3.yaml", fused=True, seq=2048))
TOKENS = 8 * 2048
NEW_END = _base.TwoStreamBlock.end


def old_end(self, xs, ys, out):
    """TwoStreamBlock.end before the change: the last block's end unfused."""
    if self.fused_streams and not self.is_last:
        return _base.stream_add(xs, ys, out, scale=1.0 / self.depth_scale)
    return self.finish([xs + out / self.depth_scale, ys + out])


def last_block_cost(model_type: str, tokens: int):
    """(bytes, kernels) of the last block of a 3-layer model compiled alone, forward + backward, at ``tokens``."""
    costs = costmodel._compiled_middle_block(CONFIG, model_type, tokens, index=2).values()
    return sum(c.bytes for c in costs), sum(c.kernels for c in costs)


def main() -> None:
    moved = {}
    for label, model_type, end in (("pre", "pre", NEW_END), ("post_pre, before", "post_pre", old_end),
                                   ("post_pre, now", "post_pre", NEW_END), ("hybrid_pre, before", "hybrid_pre", old_end),
                                   ("hybrid_pre, now", "hybrid_pre", NEW_END)):
        _base.TwoStreamBlock.end = end
        try:  # two token counts carried linearly to the recipe's, as the cost model's compiled count does
            (a, kernels), (b, _) = last_block_cost(model_type, 64), last_block_cost(model_type, 128)
        finally:
            _base.TwoStreamBlock.end = NEW_END
        moved[label] = (a + (b - a) / 64 * (TOKENS - 64)) / 1e9
        print(f"{label}: last block compiled, {moved[label]:.2f} GB, {kernels} kernels", flush=True)
    bandwidth = costmodel.DEVICES["h100-80gb"]["gbps"] * 1e9 * costmodel.BANDWIDTH_EFFICIENCY
    for model_type in ("post_pre", "hybrid_pre"):
        saved = moved[f"{model_type}, before"] - moved[f"{model_type}, now"]
        print(f"{model_type}: the one-op end saves {saved:.2f} GB a step compiled, {saved * 1e9 / bandwidth * 1e3:.2f} "
              f"ms on an H100 at the model's bandwidth", flush=True)


if __name__ == "__main__":
    main()
