"""Crafted checkpoints (issue 20): each attack class an audit demonstrated against the old loader, through the entry
points a user runs. The payloads really run when loaded without checks (test_the_chain_runs_when_unpickled_freely),
so a test that does not see the marker is evidence."""

import base64
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cluster import checkpointed_mixln, data, env, error_line, train  # noqa: F401  (fixtures)
from test_training import ROOT, learnable_tokens

from siamesenorm.checkpoints import UnsafeCheckpoint, check_saved_yaml
from siamesenorm.safeload import check_torch_file, load, load_olmo_safetensors


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


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_getattr_chain_in_a_sharded_checkpoint_never_runs(tmp_path, checkpointed_mixln, entry):
    marker = tmp_path / "payload-ran"
    folder = sharded_folder(tmp_path, checkpointed_mixln / "step4-unsharded",
                            lambda p: torch.save({"model": {}, "x": getattr_chain(marker)}, p))
    line = error_line(script(entry, *ENTRY_POINTS[entry](folder, tmp_path)))
    assert f"refusing to load {folder / 'rank0.pt'}: an attribute look-up ('exists')" in line
    assert not marker.exists(), "the payload ran"


def test_memo_stack_global_is_seen_and_refused(tmp_path, checkpointed_mixln):
    marker = tmp_path / "payload-ran"
    folder = sharded_folder(tmp_path, checkpointed_mixln / "step4-unsharded",
                            lambda p: torch_zip(p, memo_stack_global(marker)))
    line = error_line(script("analyze.py", *ENTRY_POINTS["analyze.py"](folder, tmp_path)))
    assert "it refers to os.system, which is not on the checkpoint allow-list" in line
    assert not marker.exists()


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


def test_numpy_array_larger_than_its_bytes_is_refused_in_bounded_memory(tmp_path, checkpointed_mixln):
    folder = tmp_path / "np" / "step4-unsharded"
    shutil.copytree(checkpointed_mixln / "step4-unsharded", folder)
    torch.save({"bomb": _NumpyBomb()}, folder / "model.pt")
    assert (folder / "model.pt").stat().st_size < 4096
    rss, out = peak_rss_mb(f"from siamesenorm.checkpoints import load_model_state\ntry:\n"
                           f"    load_model_state({str(folder)!r})\nexcept Exception as e: print('REFUSED', e)")
    assert "REFUSED refusing to load" in out and "a numpy array of shape (2147483648,) with 8 bytes" in out, out
    assert rss < 1500, f"peak RSS {rss} MB"


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


def test_a_pickle_that_inflates_is_refused_without_inflating(tmp_path):
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("archive/data.pkl", "w", force_zip64=True) as f:
            chunk = b"\0" * 2**20
            for _ in range(1024):
                f.write(chunk)
        zf.writestr("archive/version", "3\n")
    assert path.stat().st_size < 8 * 2**20
    rss, out = peak_rss_mb(f"from siamesenorm.safeload import load\ntry:\n    load({str(path)!r})\n"
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
    from siamesenorm import safeload

    bound = safeload._ShardedBound(1000)
    with pytest.raises(safeload._Refused, match="more than the checkpoint's files hold"):
        bound.check((2**20, 2**20), "sharded tensor")
    bound.check((10, 10), "sharded tensor")  # within: no error


# ---- 3. a checkpoint's config.yaml --------------------------------------------------------------------------------
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
