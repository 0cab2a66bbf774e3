"""Crafted checkpoints: each attack class an audit demonstrated against the old loader, through the entry
points a user runs. The payloads really run when loaded without checks (test_the_chain_runs_when_unpickled_freely),
so a test that does not see the marker is evidence."""

import base64
import io
import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_cluster import checkpointed_mixln, data, env, error_line, train  # noqa: F401  (fixtures)
from test_training import ROOT

from siamesenorm.run.checkpoints import UnsafeCheckpoint, check_saved_yaml
from siamesenorm.run.safeload import check_torch_file, load, load_olmo_safetensors


# ---- payloads --------------------------------------------------------------------------------------------------
class _Call:
    """Pickles as ``func(*args)``; func and args may be _Call objects themselves."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args

    def __call__(self, *args):  # the pickler wants a callable first item; this one is only ever pickled
        raise AssertionError("not called")


def getattr_chain(marker: Path):
    """os.system reached with only builtins.getattr and pathlib.PosixPath: a function's __globals__ holds os."""
    exists = _Call(getattr, pathlib.PosixPath, "exists")
    module_globals = _Call(getattr, exists, "__globals__")
    os_module = _Call(_Call(getattr, module_globals, "get"), "os")
    return _Call(_Call(getattr, os_module, "system"), f"touch {marker}")


def memo_stack_global(marker: Path) -> bytes:
    """A pickle naming os.system with STACK_GLOBAL on strings fetched from the memo, after two harmless strings (the
    old static scan read STACK_GLOBAL as 'the last two strings seen')."""
    command = f"touch {marker}".encode()
    return b"".join([
        b"\x80\x04", b"\x8c\x02os\x94", b"\x8c\x06system\x94", b"0", b"0",
        b"\x8c\x0bcollections", b"0", b"\x8c\x0bOrderedDict", b"0",
        b"h\x00", b"h\x01", b"\x93",  # BINGET 0, BINGET 1, STACK_GLOBAL
        b"\x8c" + bytes([len(command)]) + command, b"\x85", b"R",  # (command,) REDUCE
        b".",
    ])


def torch_zip(path: Path, pickle_bytes: bytes, compress: bool = False) -> Path:
    """A torch checkpoint archive around ``pickle_bytes`` (the layout torch.save writes)."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


def sharded_folder(tmp_path: Path, source: Path, payload_file) -> Path:
    """A torch_legacy sharded checkpoint folder (config.yaml + rank0.pt) whose rank file is the payload."""
    folder = tmp_path / "sharded" / "step4"
    folder.mkdir(parents=True)
    shutil.copy(source / "config.yaml", folder / "config.yaml")
    payload_file(folder / "rank0.pt")
    return folder


def script(name, *args, **extra_env):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], cwd=ROOT,
                          env=env(**extra_env), capture_output=True, text=True, timeout=300)


ENTRY_POINTS = {
    "analyze.py": lambda folder, tmp: ("magnitudes", folder, "--text", ROOT / "data" / "austen.jsonl.gz",
                                       "--output", tmp / "out"),
    "export_hf.py": lambda folder, tmp: (folder, tmp / "export"),
    "generate.py": lambda folder, tmp: (folder, "--prompt", "It is"),
}


# ---- 1. code execution --------------------------------------------------------------------------------------------
def test_the_chain_runs_when_unpickled_freely(tmp_path):
    """The payloads below are live: an unrestricted unpickler runs both."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(getattr_chain(marker)))
    assert marker.exists()
    marker.unlink()
    pickle.loads(memo_stack_global(marker))
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_getattr_chain_in_a_sharded_checkpoint_never_runs(tmp_path, checkpointed_mixln, entry):
    marker = tmp_path / "payload-ran"
    folder = sharded_folder(tmp_path, checkpointed_mixln / "step4-unsharded",
                            lambda p: torch.save({"model": {}, "x": getattr_chain(marker)}, p))
    line = error_line(script(entry, *ENTRY_POINTS[entry](folder, tmp_path)))
    assert f"refusing to load {folder / 'rank0.pt'}: an attribute look-up ('exists')" in line
    assert not marker.exists(), "the payload ran"


@pytest.mark.slow
def test_memo_stack_global_is_seen_and_refused(tmp_path, checkpointed_mixln):
    marker = tmp_path / "payload-ran"
    folder = sharded_folder(tmp_path, checkpointed_mixln / "step4-unsharded",
                            lambda p: torch_zip(p, memo_stack_global(marker)))
    line = error_line(script("analyze.py", *ENTRY_POINTS["analyze.py"](folder, tmp_path)))
    assert "it refers to os.system, which is not on the checkpoint allow-list" in line
    assert not marker.exists()


@pytest.mark.slow
def test_safetensors_with_a_pickled_name_is_read_without_running_it(tmp_path, checkpointed_mixln, data):  # noqa: F811
    import safetensors.torch
    from test_cluster import Payload

    marker = tmp_path / "payload-ran"
    Payload.marker = marker
    folder = tmp_path / "st" / "step4-unsharded"
    shutil.copytree(checkpointed_mixln / "step4-unsharded", folder)
    name = base64.urlsafe_b64encode(pickle.dumps(Payload())).decode()
    safetensors.torch.save_file({name: torch.zeros(2)}, str(folder / "model.safetensors"))
    proc = train([f"--data.paths=[{data}]", f"--save_folder={tmp_path / 'new'}", f"--load_path={folder}",
                  "--model.mixln_post_fraction=0.5", "--max_duration=6"], check=False, MODEL_TYPE="mixln")
    line = error_line(proc)
    assert f"refusing to load {folder / 'model.safetensors'}" in line and "posix.system" in line
    assert not marker.exists() and "[step=" not in proc.stdout + proc.stderr


def test_olmo_safetensors_written_by_olmo_still_load(tmp_path):
    """OLMo's own safetensors files (names pickled as plain tuples) load as OLMo would read them."""
    from olmo.safetensors_util import safetensors_file_to_state_dict, state_dict_to_safetensors_file

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7, "names": ["a", "b"]}
    state_dict_to_safetensors_file(state, tmp_path / "m.safetensors")
    ours = load_olmo_safetensors(tmp_path / "m.safetensors")
    theirs = safetensors_file_to_state_dict(tmp_path / "m.safetensors")
    assert ours["step"] == theirs["step"] == 7 and ours["names"] == ["a", "b"]
    assert torch.equal(ours["model"]["w"], theirs["model"]["w"])


# ---- 2. allocation bounds -------------------------------------------------------------------------------------------
class _NumpyBomb:
    def __reduce__(self):
        return (np.core.multiarray._reconstruct, (np.ndarray, (0,), b"b"),
                (1, (2**31,), np.dtype("f8"), False, b"\0" * 8))


def peak_rss_mb(code: str) -> tuple[int, str]:
    """Run ``code`` in a fresh Python; return (its peak RSS in MB, its output). VmHWM belongs to the new program's
    memory (ru_maxrss would carry over the forking pytest process's peak across exec)."""
    hwm = ("\nimport re; print('RSS', int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())"
           ".group(1)) // 1024)")
    proc = subprocess.run([sys.executable, "-c", code + hwm], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    rss = int(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RSS")))
    return rss, proc.stdout + proc.stderr


@pytest.mark.slow
def test_numpy_array_larger_than_its_bytes_is_refused_in_bounded_memory(tmp_path, checkpointed_mixln):
    folder = tmp_path / "np" / "step4-unsharded"
    shutil.copytree(checkpointed_mixln / "step4-unsharded", folder)
    torch.save({"bomb": _NumpyBomb()}, folder / "model.pt")
    assert (folder / "model.pt").stat().st_size < 4096
    rss, out = peak_rss_mb(f"from siamesenorm.run.checkpoints import load_model_state\ntry:\n"
                           f"    load_model_state({str(folder)!r})\nexcept Exception as e: print('REFUSED', e)")
    assert "REFUSED refusing to load" in out and "a numpy array of shape (2147483648,) with 8 bytes" in out, out
    assert rss < 1500, f"peak RSS {rss} MB"


@pytest.mark.slow
def test_stride_zero_tensor_in_the_optimizer_state_is_refused_before_any_step(tmp_path, checkpointed_mixln,
                                                                               data):  # noqa: F811
    folder = tmp_path / "stride" / "step4-unsharded"
    shutil.copytree(checkpointed_mixln / "step4-unsharded", folder)
    optim = load(folder / "optim.pt")
    optim["state"][0]["exp_avg"] = torch.zeros(2).as_strided((2**28,), (0,))
    torch.save(optim, folder / "optim.pt")
    assert (folder / "optim.pt").stat().st_size < 2**20
    proc = train([f"--data.paths=[{data}]", f"--save_folder={tmp_path / 'new'}", f"--load_path={folder}",
                  "--model.mixln_post_fraction=0.5", "--max_duration=6"], check=False, MODEL_TYPE="mixln")
    assert "a tensor of 268,435,456 elements viewing a storage of 2" in error_line(proc)
    assert "[step=" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_pickle_that_inflates_is_refused_without_inflating(tmp_path):
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("archive/data.pkl", "w", force_zip64=True) as f:
            chunk = b"\0" * 2**20
            for _ in range(1024):
                f.write(chunk)
        zf.writestr("archive/version", "3\n")
    assert path.stat().st_size < 8 * 2**20
    rss, out = peak_rss_mb(f"from siamesenorm.run.safeload import load\ntry:\n    load({str(path)!r})\n"
                           "except Exception as e: print('REFUSED', e)")
    assert "REFUSED" in out and "compressed member archive/data.pkl" in out, out
    assert rss < 1000, f"peak RSS {rss} MB"


def test_storage_and_view_bounds(tmp_path):
    """The checks that keep allocation within the file, one by one, on files torch itself wrote."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10.0)[2:8], "a": np.arange(4)}, good)
    assert torch.equal(load(good)["w"], torch.arange(2.0, 8.0))
    # a storage whose member holds fewer bytes than it claims
    short = tmp_path / "short.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(short, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            dst.writestr(info.filename, body[:8] if "/data/" in info.filename else body)
    with pytest.raises(UnsafeCheckpoint, match="claims 10 elements of torch.float32 but holds 8 bytes"):
        load(short)
    # two members of one name, a member outside the archive's folder
    dup = tmp_path / "dup.pt"
    shutil.copy(good, dup)
    with zipfile.ZipFile(dup, "a") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it is asked to write
        zf.writestr(zf.namelist()[0].split("/")[0] + "/data.pkl", b"\x80\x02}q\x00.")
    with pytest.raises(UnsafeCheckpoint, match="two members of the same name"):
        load(dup)
    not_zip = tmp_path / "plain.pt"
    not_zip.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeCheckpoint, match="not a zip archive"):
        load(not_zip)


def test_sharded_sizes_beyond_the_files_are_refused(tmp_path):
    """A ShardedTensor's metadata may not claim more elements than the checkpoint's files hold (OLMo's unshard
    allocates shared memory from it). The bound itself; test_training's FSDP resume passes real rank files through it."""
    from siamesenorm.run import safeload

    bound = safeload._ShardedBound(1000)
    with pytest.raises(safeload._Refused, match="more than the checkpoint's files hold"):
        bound.check((2**20, 2**20), "sharded tensor")
    bound.check((10, 10), "sharded tensor")  # within: no error


# ---- 3. a checkpoint's config.yaml --------------------------------------------------------------------------------
@pytest.mark.slow
def test_resolvers_in_a_checkpoint_config_are_refused_and_the_secret_stays(tmp_path, checkpointed_mixln):
    folder = tmp_path / "cfg" / "step4-unsharded"
    shutil.copytree(checkpointed_mixln / "step4-unsharded", folder)
    text = (folder / "config.yaml").read_text()
    assert "\n  precision: " in text or "\nprecision: " in text
    (folder / "config.yaml").write_text(text.replace("\nprecision: fp32", "\nprecision: ${oc.env:SECRET_TOKEN,fp32}"))
    proc = script("export_hf.py", folder, tmp_path / "export", SECRET_TOKEN="s3cr3t-value")
    line = error_line(proc)
    assert "precision holds an omegaconf interpolation" in line
    assert not (tmp_path / "export").exists() or "s3cr3t-value" not in "".join(
        p.read_text(errors="ignore") for p in (tmp_path / "export").rglob("*") if p.is_file())


def test_yaml_aliases_and_oversized_configs_are_refused(tmp_path):
    bomb = tmp_path / "config.yaml"
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                                                     for p, c in zip("abcdefgh", "bcdefghi")]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(UnsafeCheckpoint, match="YAML aliases"):
        check_saved_yaml(bomb)
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * (2**20 + 10) + "\n")
    with pytest.raises(UnsafeCheckpoint, match="more than a config holds"):
        check_saved_yaml(big)
    plain = tmp_path / "plain.yaml"
    plain.write_text("model:\n  d_model: 64\n  name: '$ not an interpolation'\n")
    check_saved_yaml(plain)  # accepted


# ---- 4. one archive, no re-view, a bounded checker, one-line refusals -------------------------------------
def _stored_zip(members: dict) -> bytes:
    """A zip archive of ``members`` (name -> bytes) as Python's zipfile writes it: stored, no end-record zip64."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, body in members.items():
            zf.writestr(name, body)
    return out.getvalue()


def _saved_members(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def _split(raw: bytes) -> tuple:
    """(members' bytes, central directory, entry count) of an archive that ``_stored_zip`` wrote."""
    end = raw.rindex(b"PK\x05\x06")
    _, _, _, _, count, size, offset, _ = struct.unpack("<4sHHHHIIH", raw[end:end + 22])
    return raw[:offset], raw[offset:offset + size], count


def two_readers(benign, hostile) -> bytes:
    """One file, two archives: Python's zipfile (the old check's reader) finds torch.save(benign), torch's own reader
    torch.save(hostile). zipfile shifts every offset by the bytes it finds before the central directory; torch's
    reader takes the offsets as written. The end record's offsets point at the hostile central directory placed
    where the benign archive's central directory would begin."""
    hm, hc, count = _split(_stored_zip(_saved_members(hostile)))
    bm, bc, _ = _split(_stored_zip(_saved_members(benign)))
    assert len(hm) <= len(bm) and len(hc) <= len(bc)
    body = hm + b"\0" * (len(bm) - len(hm)) + hc + b"\0" * (len(bc) - len(hc)) + bm + bc
    return body + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, len(bc), len(bm), 0)


def test_an_archive_that_two_readers_read_differently_is_refused(tmp_path):
    padding = {f"padding-{i:04d}-" + "x" * 40: torch.zeros(64) for i in range(8)}
    path = tmp_path / "model.pt"
    path.write_bytes(two_readers({"w": torch.zeros(4), **padding}, {"w": torch.full((4,), 7.0)}))
    with zipfile.ZipFile(path) as zf:  # the reader the old check used: the benign archive, 10 tensors
        assert sum("/data/" in n for n in zf.namelist()) == 9
    assert torch.load(path, weights_only=True)["w"].tolist() == [7.0] * 4  # torch: the other archive
    with pytest.raises(UnsafeCheckpoint, match="two readers would see two archives"):
        load(path)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(3.0)}, good)
    raw = good.read_bytes()
    for name, crafted, why in [
            ("prepended", b"\0" * 64 + raw, "zip64 end record is not right before its locator"),
            ("prepended-plain", b"\0" * 64 + _stored_zip(_saved_members({})), "two readers would see two archives"),
            ("trailing", raw + b"\0", "not a zip archive that ends with its end record"),
            ("comment", raw[:-2] + b"\x01\x00x", "not a zip archive that ends with its end record"),
            ("case", _stored_zip({"archive/data.pkl": _saved_members({})["archive/data.pkl"],
                                  "archive/DATA.pkl": b"x"}), "two members of the same name")]:
        (tmp_path / name).write_bytes(crafted)
        with pytest.raises(UnsafeCheckpoint, match=why):
            load(tmp_path / name)
    assert load(good)["w"].tolist() == [0.0, 1.0, 2.0]  # torch's own layout: zip64 records, data descriptors
    assert load(io.BytesIO(_stored_zip(_saved_members({"w": torch.ones(2)}))))["w"].tolist() == [1.0, 1.0]


class _ReView:
    """Pickles as an honest two-element tensor, then a BUILD with a dict state: torch's reader calls
    ``tensor.set_(*state)`` with the dict's keys (storage, 0, (n,), (0,)): n elements over 8 bytes."""

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        t = torch.arange(2.0)
        storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2, (storage, 0, (2,), (1,), False, OrderedDict()),
                {storage: None, 0: None, (self.n,): None, (0,): None})


def test_a_build_step_that_re_views_a_checked_tensor_is_refused(tmp_path):
    path = tmp_path / "optim.pt"
    torch.save({"state": {0: {"exp_avg": _ReView(4_000_000_000)}}}, path)
    assert path.stat().st_size < 2048
    revived = torch.load(path, weights_only=True)["state"][0]["exp_avg"]  # live: torch alone re-views it
    assert revived.shape == (4_000_000_000,) and revived.untyped_storage().nbytes() == 8
    with pytest.raises(UnsafeCheckpoint, match="a BUILD step on a tensor"):
        load(path)


def test_a_memo_index_far_beyond_the_pickle_is_refused_in_bounded_memory(tmp_path):
    path = torch_zip(tmp_path / "model.pt", b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b".")
    rss, out = peak_rss_mb(f"from siamesenorm.run.safeload import load\ntry:\n    load({str(path)!r})\n"
                           "except Exception as e: print('REFUSED', e)")
    assert "REFUSED" in out and "a memo index 2,147,483,648 beyond the 0 objects stored before it" in out, out
    assert rss < 1000, f"peak RSS {rss} MB"


def _dicts_and_floats(dicts: int, units: int) -> bytes:
    """A list of ``units`` x (``dicts`` empty dicts and a float): the cheapest objects a byte makes."""
    unit = b"}" * dicts + b"G" + struct.pack(">d", 1.5)
    return b"\x80\x04](" + unit * units + b"e."


@pytest.mark.slow
def test_the_checker_spends_at_most_its_bound_per_byte_of_pickle(tmp_path):
    import tracemalloc

    from siamesenorm.run.safeload import CHECK_BYTES_PER_PICKLE_BYTE, MAX_PICKLE_BYTES, prescan_pickle

    prescan_pickle(_saved_members({"model": {f"w{i}": torch.zeros(3) for i in range(50)}, "step": 3,
                                   "x": [1.5] * 20})["archive/data.pkl"])  # an ordinary pickle: accepted
    at_limit = _dicts_and_floats(12, 100_000)  # 12 x 160 + 80 = 2,000 of 21 x 96 = 2,016 a unit
    over = _dicts_and_floats(14, 100_000)
    for data, accepted in ((at_limit, True), (over, False)):
        path = torch_zip(tmp_path / f"pickle-{accepted}.pt", data)
        tracemalloc.start()
        try:
            with open(path, "rb") as f:
                if accepted:
                    check_torch_file(f, "crafted")
                else:
                    with pytest.raises(UnsafeCheckpoint, match="would make about"):
                        check_torch_file(f, "crafted")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= CHECK_BYTES_PER_PICKLE_BYTE * len(data) + 2**20, (accepted, peak / len(data))
        if not accepted:  # refused by the scan, before any object is made: the pickle itself and little more
            assert peak <= 2 * len(data) + 2**20, peak / len(data)
    assert MAX_PICKLE_BYTES * CHECK_BYTES_PER_PICKLE_BYTE <= 8 * 2**30  # the checker's worst case, for any file


def _substituted(source: Path, old: bytes, new: bytes, out: Path) -> Path:
    """``source`` rewritten with ``old`` replaced by ``new`` in its pickle."""
    with zipfile.ZipFile(source) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    assert old in members[pkl]
    members[pkl] = members[pkl].replace(old, new)
    out.write_bytes(_stored_zip(members))
    return out


def test_what_torch_refuses_after_our_check_is_one_line_without_weights_only_advice(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(3.0)}, good)
    crafted = _substituted(good, b"\x03\x00\x00\x00cpu", b"\x03\x00\x00\x00xla", tmp_path / "crafted.pt")
    with pytest.raises(RuntimeError, match="don't know how to restore data location"):  # torch alone: its error
        torch.load(crafted, weights_only=True)
    with pytest.raises(UnsafeCheckpoint) as refused:
        load(crafted)
    message = str(refused.value)
    assert message.startswith(f"refusing to load {crafted}: torch's restricted reader refused it after our check")
    assert "\n" not in message and "weights_only" not in message
    from siamesenorm.run.safeload import _plain

    assert _plain(RuntimeError("Weights only load failed.\nRe-running `torch.load` with `weights_only` set to "
                               "`False` will likely succeed")) == "refused by torch's restricted reader"


# ---- 5. scripts we write for others to run ------------------------------------------------------------------------
@pytest.mark.parametrize("option, value", [("--job-name", "x\nrm -rf ~"), ("--time", "1-00:00:00\n#SBATCH --x"),
                                           ("--partition", "gpu; touch /tmp/p"), ("--job-name", "a b"),
                                           ("override", "--save_folder=a\ntouch /tmp/p"),
                                           ("override", "--save_folder=a\rb")])
def test_a_batch_script_refuses_values_that_would_add_a_command(tmp_path, option, value):
    out = tmp_path / "job.sbatch"
    args = [str(ROOT / "configs" / "tiny-cpu.yaml"), "--output", str(out)]
    args += [value] if option == "override" else [option, value]
    proc = script(str(Path("slurm") / "make_sbatch.py"), *args)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("make_sbatch.py: error: ")
    assert "control character" in proc.stderr or "is not a SLURM" in proc.stderr


def test_a_batch_script_names_its_model_type_and_beats_a_stale_environment(tmp_path):
    from siamesenorm.cluster.slurm import sbatch_script

    text = sbatch_script("configs/tiny-cpu.yaml", ["--save_folder=runs/it's here"], model_type="hybrid_pre",
                         job_name="hp", time="1-00:00:00", partition="gpu")
    assert "MODEL_TYPE=hybrid_pre python scripts/preflight.py configs/tiny-cpu.yaml" in text
    prologue = text.split("export OLMO_SHARED_FS", 1)[0].split("set -euo pipefail", 1)[1] + 'echo "$MODEL_TYPE"\n'
    proc = subprocess.run(["bash", "-c", prologue], env={**os.environ, "MODEL_TYPE": "pre",
                                                         "SLURM_SUBMIT_DIR": str(tmp_path)},
                          capture_output=True, text=True)
    assert proc.stdout.strip() == "hybrid_pre"  # the script's MODEL_TYPE, not the shell's
    assert "the environment's MODEL_TYPE=pre is ignored" in proc.stderr


def test_the_gpu_check_installs_into_a_fresh_private_folder_and_removes_it(tmp_path):
    """scripts/gpu_check.sh with a stand-in Python (it sees a GPU, records pip's target and the check's path)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1-py3-none-any.whl").write_bytes(b"")
    log = tmp_path / "log"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ]; then
  for a in "$@"; do [ "$prev" = "--target" ] && stat -c "target %n %a" "$a" >> {log}; prev="$a"; done
elif [ "$1" = "scripts/gpu_check.py" ]; then
  echo "pythonpath $PYTHONPATH" >> {log}
fi
exit 0
""")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(wheels), str(tmp_path / "r.md")],
                          env={**os.environ, "PYTHON": str(fake), "TMPDIR": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    target, path = log.read_text().splitlines()
    _, folder, mode = target.split()
    assert folder.startswith(str(tmp_path / "siamesenorm-site.")) and mode == "700"
    assert path.split()[1].split(":")[1] == folder  # on the path: that folder, no fixed /tmp name
    assert not Path(folder).exists()  # removed when the check ended


# ---- 6. exported folders from elsewhere -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory, checkpointed_mixln):
    """A real export (mixln, with its modelling code) to copy and craft from."""
    out = tmp_path_factory.mktemp("export") / "mixln"
    proc = script("export_hf.py", checkpointed_mixln, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _crafted_export(source: Path, tmp_path: Path, case: str) -> tuple:
    """A copy of ``source`` with ``case`` planted; (folder, the words its one-line refusal must hold)."""
    folder = tmp_path / case
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    if case == "huge_model":
        config["olmo"].update(d_model=2**20, n_layers=100_000)
        (folder / "config.json").write_text(json.dumps(config))
        return folder, "not a number from 0 to"
    if case == "more_layers":  # within the bounds, but not the model the weights are
        config["olmo"]["n_layers"] = 64
        (folder / "config.json").write_text(json.dumps(config))
        return folder, "its tensors are not the model's that config.json states"
    if case == "not_object":
        (folder / "config.json").write_text("[1, 2, 3]")
        return folder, "a JSON list, not an object"
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    if case == "header_length":
        weights.write_bytes(struct.pack("<Q", 2**40) + raw[8:])
        return folder, "a safetensors header of 1,099,511,627,776 bytes"
    if case == "offsets_outside":
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 2**30
        header[name]["data_offsets"][0] += 2**30
    elif case == "remote_tokenizer":
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        tok["auto_map"] = {"AutoTokenizer": ["tok.Evil", None]}
        (folder / "tokenizer_config.json").write_text(json.dumps(tok))
        return folder, "a tokenizer that needs code of its own"
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return folder, "lies outside the file"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["huge_model", "more_layers", "not_object", "header_length", "offsets_outside",
                                  "remote_tokenizer"])
def test_a_crafted_export_is_refused_in_one_line_before_anything_is_built(tmp_path, exported, case):
    folder, words = _crafted_export(exported, tmp_path, case)
    rss, out = peak_rss_mb(f"import sys; sys.argv = ['generate.py', {str(folder)!r}, '--prompt', 'It is']\n"
                           "from siamesenorm.cli.commands import generate_main\ntry:\n    generate_main()\n"
                           "except SystemExit as e: print('EXIT', e.code)")
    assert "EXIT 2" in out, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("error: "))
    assert line.startswith("error: refusing to load ") and words in line, line
    assert "trust_remote_code" not in out and "Traceback" not in out
    assert rss < 1500, f"peak RSS {rss} MB"


# ---- 7. records, metrics, sweep plans and results folders -----------------------------------------------------------
def _run_folder(tmp_path: Path, record: Any = None, metrics: str = None) -> Path:
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    good = {"model_type": "pre", "learning_rate": 1e-3, "status": "finished", "val_perplexity": 30.0, "step": 4,
            "perplexity": {"val": 30.0}, "downstream": {}}
    text = record if isinstance(record, str) else json.dumps(good if record is None else {**good, **record})
    (folder / "run.json").write_text(text)
    (folder / "metrics.jsonl").write_text(metrics if metrics is not None else "".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0}) + "\n" for s in range(1, 5)))
    return folder


def _nested(depth: int):
    value = [1]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.slow
@pytest.mark.parametrize("record, words", [
    ({"learning_rate": "1e-3"}, "field learning_rate is str '1e-3'"),
    ({"val_perplexity": [1, 2]}, "field val_perplexity is list"),
    ({"downstream": {"piqa": "high"}}, "field downstream.piqa is str"),
    ({"status": True}, "field status is true/false"),
    ("[" * 100_000 + "]" * 100_000, "not a JSON run record (RecursionError)"),
    (json.dumps({"model_type": "pre", "learning_rate": 1, "status": "x", "deep": _nested(40)}),
     "nested deeper than 32 levels"),
    ("[1, 2]", "a JSON list, not a run record")])
def test_a_run_record_of_the_wrong_shape_is_one_line_in_make_tables(tmp_path, record, words):
    folder = _run_folder(tmp_path, record)
    proc = script("make_tables.py", tmp_path / "runs")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {folder / 'run.json'}: ") and words in line, line


@pytest.mark.slow
@pytest.mark.parametrize("metrics, words", [('{"step": "4", "loss": 1.0}\n', "field step is not a number"),
                                            ('{"step": 4, "loss": "low"}\n', "field loss is not a number"),
                                            ("[1, 2]\n", "not a metrics line (an object)")])
def test_a_metrics_line_of_the_wrong_shape_is_one_line_in_analyze(tmp_path, metrics, words):
    folder = _run_folder(tmp_path, metrics=metrics)
    proc = script("analyze.py", "loss-curves", folder, "--output", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {folder / 'metrics.jsonl'}:1: ") and words in line, line


@pytest.mark.slow
def test_a_folder_that_is_not_a_sweeps_results_is_one_line_in_study_report(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = script("study_report.py", tmp_path / "empty", "--output", tmp_path / "out")
    assert proc.returncode == 2 and "not a sweep's results folder" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    cell = _run_folder(tmp_path, {"learning_rate": "fast"})
    proc = script("study_report.py", cell.parent, "--output", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "field learning_rate is str" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("group, words", [
    ({"methods": ["../../../tmp/x"], "learning_rates": [1e-2]}, "group 1 methods holds '../../../tmp/x'"),
    ({"methods": ["pre"], "learning_rates": ["fast"]}, "group 1 learning_rates holds 'fast'"),
    ({"methods": ["pre"], "learning_rates": [1e-2], "seeds": [1.5]}, "group 1 seeds holds 1.5"),
    ({"methods": ["pre"], "learning_rates": [1e-2], "knobs": {"n_layers": "4/../../x"}}, "group 1 knobs must map"),
    ({"methods": "pre", "learning_rates": [1e-2]}, "group 1 methods must be a non-empty list")])
def test_a_sweep_plan_with_bad_values_is_one_line_before_any_folder(tmp_path, group, words):
    plan = tmp_path / "plan.yaml"
    plan.write_text(json.dumps({"recipe": "configs/tiny-cpu.yaml", "runs": str(tmp_path / "runs"),
                                "results": str(tmp_path / "results"), "groups": [group]}))
    proc = script("sweep.py", plan, "--list")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {plan}: ") and words in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()


def test_a_plain_tensors_state_may_set_flags_but_not_its_data(tmp_path):
    """FSDP writes plain tensors with a flag in their state (``_has_been_cloned``): accepted; a state that sets
    ``data`` (another view in place of the checked one) is refused."""
    flagged = torch.arange(3.0)
    flagged._has_been_cloned = True  # what FSDP sets; torch.save writes it as the tensor's state
    torch.save({"w": flagged}, tmp_path / "flag.pt")
    loaded = load(tmp_path / "flag.pt")["w"]
    assert loaded.tolist() == [0.0, 1.0, 2.0] and loaded._has_been_cloned is True
    for state in ({"data": "x"}, {"grad": None}):  # torch.save never writes these: crafted
        torch.save({"w": _StateTensor(state)}, tmp_path / "crafted.pt")
        with pytest.raises(UnsafeCheckpoint, match="sets more than plain attributes"):
            load(tmp_path / "crafted.pt")


class _StateTensor:
    """Pickles as torch._tensor._rebuild_from_type_v2(_rebuild_tensor_v2, Tensor, (...), state)."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        t = torch.arange(3.0)
        storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
        args = (storage, 0, (3,), (1,), False, OrderedDict())
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, torch.Tensor, args, self.state)


def test_a_compressed_metrics_file_is_read_bounded_and_a_broken_one_is_one_line(tmp_path, monkeypatch):
    """Study results keep metrics.jsonl.gz; the readers take it, the same bytes for the same lines, and a gzip bomb or
    a truncated file from elsewhere is one line, never an unbounded read."""
    import gzip

    from siamesenorm.run import records

    plain = tmp_path / "metrics.jsonl"
    plain.write_text("".join(json.dumps({"step": i, "loss": 5.0 - i / 10}) + "\n" for i in range(1, 40)))
    first = records.compress_metrics(plain, tmp_path / "a.jsonl.gz").read_bytes()
    assert records.compress_metrics(plain, tmp_path / "b.jsonl.gz").read_bytes() == first  # deterministic
    assert records.read_metrics_rows(tmp_path / "a.jsonl.gz") == records.read_metrics_rows(plain)
    monkeypatch.setattr(records, "MAX_METRICS_BYTES", 10_000)
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"\n" * 1_000_000))  # 1 MB of text in about 1 kB
    with pytest.raises(ValueError, match="more than 10,000 bytes of metrics"):
        records.read_metrics_rows(bomb)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(first[: len(first) // 2])
    with pytest.raises(ValueError, match="not a readable metrics file"):
        records.read_metrics_rows(cut)
