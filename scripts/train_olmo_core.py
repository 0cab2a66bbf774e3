"""Train a MODEL_TYPE with OLMo-core 3's Trainer from one of our recipes (siamesenorm/olmo_core/train.py).

  MODEL_TYPE=hybrid_pre python scripts/train_olmo_core.py configs/tiny-cpu.yaml --save_folder=runs/core-hybrid_pre
  MODEL_TYPE=hybrid_pre torchrun --nproc_per_node 2 scripts/train_olmo_core.py configs/tiny-cpu.yaml ...
"""

from siamesenorm.cli.commands import olmo_core_train_main

if __name__ == "__main__":
    olmo_core_train_main()
