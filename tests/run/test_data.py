"""Data preparation: equal to a reference tokenization, resumable to identical files, and strict about bad input."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from olmo.tokenizer import Tokenizer

from siamesenorm.run import data as D
from siamesenorm.run.data import DataPreparationError, PrepareSettings, is_validation, prepare

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer-austen-2k.json")


def austen_docs(n=40):
    with gzip.open(ROOT / "data" / "austen.jsonl.gz", "rt") as f:
        return [json.loads(next(f))["text"][:3000] for _ in range(n)]


def write_jsonl(path: Path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def read_split(out: Path, split: str, dtype=np.uint16):
    files = sorted((out / split).glob("*.npy"))
    return np.concatenate([np.fromfile(f, dtype=dtype) for f in files]) if files else np.array([], dtype)


def test_output_equals_reference_tokenization(tmp_path):
    docs = austen_docs(30)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    manifest = prepare(PrepareSettings([str(src)], tokenizer=TOKENIZER, docs_per_unit=7, val_fraction=0.2), tmp_path / "out",
                       progress=False)
    tok = Tokenizer.from_file(TOKENIZER, eos_token_id=0, pad_token_id=1)
    for split in ("train", "val"):
        want = [i for d in docs if is_validation(d, 0.2) == (split == "val") for i in tok.encode(d)]  # + EOS each
        assert read_split(tmp_path / "out", split).tolist() == want
    assert manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"] == 30
    assert manifest["totals"]["val"]["documents"] >= 1
    for rel, meta in manifest["files"].items():
        assert hashlib.sha256((tmp_path / "out" / rel).read_bytes()).hexdigest() == meta["sha256"]
        assert (tmp_path / "out" / rel).stat().st_size == 2 * meta["tokens"]


def test_olmo_tokenizer_vocabulary_needs_uint16_and_bigger_ones_uint32():
    assert D.memmap_dtype_for(50_280) == "uint16"
    assert D.memmap_dtype_for(100_278) == "uint32"


def test_interrupted_run_resumes_to_identical_files(tmp_path, monkeypatch):
    docs = austen_docs(40)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    settings = PrepareSettings([str(src)], tokenizer=TOKENIZER, docs_per_unit=5)
    prepare(settings, tmp_path / "clean", progress=False)

    real, calls = D._tokenize_unit, []

    def dies_after_three(job):
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")
        calls.append(job[0])
        return real(job)

    monkeypatch.setattr(D, "_tokenize_unit", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(settings, tmp_path / "resumed", progress=False)
    assert len(list((tmp_path / "resumed" / "units").glob("*.json"))) == 3
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    monkeypatch.setattr(D, "_tokenize_unit", real)
    prepare(settings, tmp_path / "resumed", progress=False)

    def tree(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert tree(tmp_path / "resumed") == tree(tmp_path / "clean")


def test_rerun_with_other_settings_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", austen_docs(3))
    prepare(PrepareSettings([str(src)], tokenizer=TOKENIZER), tmp_path / "out", progress=False)
    with pytest.raises(DataPreparationError, match="prepared with other settings"):
        prepare(PrepareSettings([str(src)], tokenizer=TOKENIZER, val_fraction=0.5), tmp_path / "out", progress=False)


def test_several_workers_give_the_same_files(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", austen_docs(20))
    settings = PrepareSettings([str(src)], tokenizer=TOKENIZER, docs_per_unit=4)
    one = prepare(settings, tmp_path / "one", num_workers=1, progress=False)
    two = prepare(settings, tmp_path / "two", num_workers=2, progress=False)
    assert one["files"] == two["files"]


def test_malformed_jsonl_lines_and_empty_input_are_counted_skips(tmp_path):
    good = austen_docs(4)
    lines = [json.dumps({"text": good[0]}), "{not json", json.dumps({"body": "no text field"}),
             json.dumps({"text": "   "}), json.dumps({"text": good[1]})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "b.txt").write_text(good[2])
    manifest = prepare(PrepareSettings([str(tmp_path)], tokenizer=TOKENIZER), tmp_path / "out", progress=False)
    skipped = manifest["skipped"]
    assert (skipped["malformed_lines"], skipped["empty_documents"], skipped["empty_files"]) == (2, 1, 1)
    assert any("a.jsonl:2" in d for d in skipped["details"])
    total = manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"]
    assert total == 3
    tok = Tokenizer.from_file(TOKENIZER, eos_token_id=0, pad_token_id=1)
    everything = sorted(read_split(tmp_path / "out", "train").tolist() + read_split(tmp_path / "out", "val").tolist())
    assert everything == sorted(i for d in (good[0], good[1], good[2]) for i in tok.encode(d))


def test_invalid_utf8_is_a_clear_error_and_keeps_finished_units(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for i, text in enumerate(austen_docs(4)):
        (folder / f"a{i}.txt").write_text(text)
    (folder / "z_bad.txt").write_bytes(b"fine start \xff\xfe broken")
    with pytest.raises(DataPreparationError, match=r"z_bad.txt: not valid UTF-8 \(byte 11"):
        prepare(PrepareSettings([str(folder)], tokenizer=TOKENIZER, docs_per_unit=2), tmp_path / "out",
                progress=False)
    out = tmp_path / "out"
    records = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    assert len(records) == 2  # the four good documents, in two whole units
    for r in records:
        for rel, meta in r["files"].items():
            assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == meta["sha256"]
    assert not list(out.rglob("*.tmp*")) and not (out / "manifest.json").exists()


def test_nothing_to_tokenize_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataPreparationError, match="no documents found"):
        prepare(PrepareSettings([str(tmp_path / "empty.jsonl")], tokenizer=TOKENIZER), tmp_path / "o", progress=False)
    with pytest.raises(DataPreparationError, match="does not exist"):
        prepare(PrepareSettings([str(tmp_path / "missing.txt")], tokenizer=TOKENIZER), tmp_path / "o2",
                progress=False)


def test_olmo_packaged_tokenizer_loads_offline():
    tok = D.load_tokenizer(D.OLMO_TOKENIZER)
    assert tok.get_vocab_size() >= 50_277 and D.default_eos_id(tok) == 50_279


def test_changed_input_content_is_retokenized_not_reused(tmp_path):
    """Same paths and settings, one document edited and the input shortened: the edited unit is tokenized again,
    units past the new end are removed, and the result equals a clean run on the new input."""
    docs = austen_docs(20)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    settings = PrepareSettings([str(src)], tokenizer=TOKENIZER, docs_per_unit=5)
    prepare(settings, tmp_path / "out", progress=False)
    before = json.loads((tmp_path / "out" / "manifest.json").read_text())
    edited = docs[:15]
    edited[7] = edited[7].replace("the", "THE")  # unit 1 changes
    write_jsonl(src, edited)
    manifest = prepare(settings, tmp_path / "out", progress=False)
    prepare(settings, tmp_path / "clean", progress=False)
    clean = json.loads((tmp_path / "clean" / "manifest.json").read_text())
    assert manifest["files"] == clean["files"] and manifest["totals"] == clean["totals"]
    assert manifest["files"] != before["files"]
    assert not (tmp_path / "out" / "units" / "00003.json").exists()
    assert sorted(p.name for p in (tmp_path / "out" / "train").glob("*.npy")) == \
        sorted(p.name for p in (tmp_path / "clean" / "train").glob("*.npy"))
    for rel, meta in manifest["files"].items():
        tokens = np.fromfile(tmp_path / "out" / rel, dtype=np.uint16)
        assert meta["max_token_id"] == int(tokens.max())


def test_progress_total_counts_the_documents_cheaply(tmp_path):
    import gzip

    from siamesenorm.run.data import PrepareSettings, Skips, count_documents, iter_documents

    shipped = PrepareSettings([str(ROOT / "data" / "austen.jsonl.gz")])
    assert count_documents(shipped) == sum(1 for _ in iter_documents(shipped, Skips()))
    assert count_documents(PrepareSettings([str(ROOT / "data" / "austen.jsonl.gz")], max_documents=7)) == 7
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i}")
    with gzip.open(folder / "more.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5)))
    assert count_documents(PrepareSettings([str(folder)])) == 8
    assert count_documents(PrepareSettings(["hf:HuggingFaceFW/fineweb-edu"])) is None  # streamed: unknown


def test_an_unreachable_hub_is_one_line(tmp_path):
    """The README's FineWeb-Edu command without a network (HF_HUB_OFFLINE: fails at once, as an unreachable Hub
    does after its retries): one line that says what to do, exit 2, no traceback."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--max-documents", "10",
                           "--output", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: hf:HuggingFaceFW/fineweb-edu:sample-10BT: the Hugging Face Hub could not be read")
    assert "prepare local files instead" in line
