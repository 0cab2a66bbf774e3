"""Rebuild data/austen.jsonl.gz from Debian's r-cran-janeaustenr package (how the shipped corpus was made).

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    pip install rdata==1.1.0   # only for this script; not a project dependency
    python scripts/extract_austen.py /tmp/ja/usr/lib/R/site-library/janeaustenr/data/Rdata data/austen.jsonl.gz

The package stores the six novels as an R lazy-load database: Rdata.rdx (gzip, the index) and Rdata.rdb (one
zlib stream per novel, each an R serialisation of a character vector, one element per printed line). We rejoin
the lines into paragraphs and split each novel into chapters: one JSON line {"text", "source", "chapter"} each.
"""

import argparse
import gzip
import json
import re
import zlib

NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]
CHAPTER = re.compile(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$")


def load(base):
    import rdata  # only this script needs it (see above)

    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(open(base + ".rdx", "rb").read())))
    blob = open(base + ".rdb", "rb").read()
    for name in NOVELS:
        offset, length = (int(v) for v in index["variables"][name])
        payload = zlib.decompress(blob[offset + 4 : offset + length])
        yield name, [str(line) for line in rdata.conversion.convert(rdata.parser.parse_data(payload))]


def chapters(lines):
    current, out = [], []
    for line in lines:
        if CHAPTER.match(line):
            if current:
                out.append(current)
            current = [line.strip()]
        else:
            current.append(line)
    out.append(current)
    for chunk in out:
        paragraphs = re.split(r"\n\s*\n", "\n".join(chunk))
        text = "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())
        if len(text) > 200:
            yield text


def extract(base, out_path):
    with gzip.open(out_path, "wt", encoding="utf-8") as out:
        for name, lines in load(base):
            for i, text in enumerate(chapters(lines)):
                out.write(json.dumps({"text": text, "source": name, "chapter": i}, ensure_ascii=False) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the package's lazy-load database without its suffix (.../data/Rdata)")
    parser.add_argument("out_path", help="the .jsonl.gz file to write (one chapter per line)")
    args = parser.parse_args(argv)
    extract(args.base, args.out_path)


if __name__ == "__main__":
    main()
