"""Train with OLMo's Trainer. Logic: siamesenorm/ai2_olmo/train.py.

  MODEL_TYPE=hybrid_pre torchrun --nproc_per_node 8 scripts/train.py configs/OLMo-1B-hybrid-2e-3.yaml
  python scripts/train.py configs/tiny-cpu.yaml --dry-run
"""

from siamesenorm.cli.commands import train_main

if __name__ == "__main__":
    train_main()
