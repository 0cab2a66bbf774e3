"""Every kernel of one compiled middle block of pre, hc and mhc at the 1.3B recipe's width (fused streams on, bf16,
recompute on), forward and backward, with what it moves per token in (B, T, d) bf16 passes: where hc's and mhc's
compiled bytes above pre go, kernel by kernel. The cost model's compiled count (``costmodel._compiled_middle_block``,
inductor's own scheduler) at one sequence of 1,024 tokens; a kernel's passes are its bytes over one (1024, d) bf16
tensor's, the few fixed bytes included (an op's weights: mhc's projection 0.2 of a pass here, hc's 0.02). Matrix
products are listed apart: their FLOPs, not their bytes, set their time at the recipe's size. (Two token counts
and the growth between them, as the cost model carries them, would drop the fixed bytes, but mhc's backward
compiles to differently split kernels at every pair of sizes tried.)

    python results/cost-model/connection_kernels_compiled.py     # about 3 minutes on a 2-core CPU; output beside it
"""

from collections import Counter

from siamesenorm.perf import costmodel
from siamesenorm.perf.benchmark import BenchSettings, model_config

CONFIG = model_config(BenchSettings(recipe="configs/OLMo-1B-2e-3.yaml", fused=True, seq=2048))
TOKENS = 1024
PRODUCTS = costmodel._EXTERN_MATMULS + ("_scaled_dot_product_flash_attention_for_cpu",
                                       "_scaled_dot_product_flash_attention_for_cpu_backward")


def kernels(model_type: str):
    """{phase: [(label, passes)]} of a middle block compiled alone."""
    cost = costmodel._compiled_middle_block(CONFIG, model_type, TOKENS)
    one_pass = TOKENS * CONFIG.d_model * 2
    return {phase: [(label, nbytes / one_pass) for label, nbytes in cost[phase].kernel_list]
            for phase in ("forward", "backward")}


def main() -> None:
    totals = {}
    for model_type in ("pre", "hc", "mhc"):
        listing = kernels(model_type)
        print(f"## {model_type}")
        for phase, rows in listing.items():
            other = [(label, p) for label, p in rows if label not in PRODUCTS and p > 0.05]
            products = Counter(label for label, _ in rows if label in PRODUCTS)
            total = sum(p for _, p in other)
            totals[(model_type, phase)] = total
            print(f"{phase}: {total:.1f} passes outside the products, in {len(other)} kernels "
                  f"(and {sum(products.values())} products: {dict(products)})")
            for label, p in other:
                print(f"  {p:5.1f}  {label}")
        print()
    for model_type in ("hc", "mhc"):
        above = {ph: totals[(model_type, ph)] - totals[("pre", ph)] for ph in ("forward", "backward")}
        print(f"{model_type} above pre outside the products: forward {above['forward']:+.1f}, backward "
              f"{above['backward']:+.1f}, a layer {sum(above.values()):+.1f} passes")


if __name__ == "__main__":
    main()
