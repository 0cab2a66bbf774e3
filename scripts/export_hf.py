"""Export a run or checkpoint as a Hugging Face transformers folder. Logic: siamesenorm/export/hf.py.

  python scripts/export_hf.py --help
"""

from siamesenorm.cli.commands import export_hf_main

if __name__ == "__main__":
    export_hf_main()
