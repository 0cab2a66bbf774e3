"""Generate text from a run, checkpoint or exported folder. Logic: siamesenorm/export/hf.py.

  python scripts/generate.py --help
"""

from siamesenorm.cli.commands import generate_main

if __name__ == "__main__":
    generate_main()
