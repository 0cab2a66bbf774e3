"""Tokenize text into OLMo memmap files. Logic: siamesenorm/run/data.py.

  python scripts/prepare_data.py --output data/prepared/fineweb-edu --max-documents 1000000   # FineWeb-Edu (online)
  python scripts/prepare_data.py data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json --output runs/data/austen
  python scripts/prepare_data.py --train-tokenizer 2048 data/austen.jsonl.gz --output data/tokenizer-austen-2k.json
"""

from siamesenorm.cli.commands import prepare_data_main

if __name__ == "__main__":
    prepare_data_main()
