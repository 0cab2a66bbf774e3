"""changes.patch against ai2-olmo 0.6.0's PyPI source: applies, is up to date, and builds the same models."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from siamesenorm import MODEL_TYPES, build_model
from siamesenorm.models import olmo_patch

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "changes.patch"
CACHE = ROOT / ".cache" / "sdist"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """OLMo/ at the release tag, from the PyPI sdist (downloaded once into .cache/, checksum verified)."""
    return olmo_patch.materialize(tmp_path_factory.mktemp("olmo") / "OLMo", None, CACHE)


@pytest.mark.slow
def test_patch_applies_cleanly_and_for_real(pristine):
    subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=pristine, check=True)
    patched = olmo_patch.materialize(pristine, PATCH, CACHE)
    log = subprocess.run(["git", "log", "--format=%s"], cwd=patched, capture_output=True, text=True).stdout
    assert "changes.patch" in log.splitlines()[0] and "PyPI source distribution" in log.splitlines()[1]
    assert "SIAMESENORM_PATCHED = True" in (patched / "olmo" / "model.py").read_text()
    olmo_patch.materialize(pristine, PATCH, CACHE)  # rerunning is safe: already applied, nothing changes
    status = subprocess.run(["git", "status", "--porcelain", "olmo"], cwd=patched, capture_output=True, text=True)
    assert status.stdout == ""


def test_changes_patch_is_not_stale(pristine):
    fresh = olmo_patch.render_patch(olmo_patch.pristine_tree(pristine))
    assert PATCH.read_text() == fresh, "changes.patch is stale: run python scripts/olmo_tree.py patch"


@pytest.mark.slow
def test_patched_source_tree_builds_the_same_models(pristine, tmp_path):
    """The patched OLMo/ imported in place of the installed ai2-olmo: same state-dict names and logits for each
    type."""
    tree = olmo_patch.materialize(pristine, PATCH, CACHE)
    from conftest import tiny_config

    fields = dict(d_model=32, n_heads=4, n_layers=3, vocab_size=96, embedding_size=128, max_sequence_length=64,
                  rope=True, include_bias=False, layer_norm_type="rms", attention_dropout=0.0,
                  residual_dropout=0.0, embedding_dropout=0.0, init_device="cpu")
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = {}
    for mt in MODEL_TYPES:
        model = build_model(tiny_config(**fields), mt).eval()
        torch.save(model.state_dict(), tmp_path / f"{mt}.pt")
        with torch.no_grad():
            expected[mt] = model(ids).logits
    torch.save(ids, tmp_path / "ids.pt")

    script = textwrap.dedent(f"""
        import json, sys, torch
        import olmo, olmo.model
        from olmo.config import ModelConfig
        from olmo.model import OLMo
        assert olmo.__file__.startswith({str(tree)!r}), olmo.__file__
        ids = torch.load({str(tmp_path / 'ids.pt')!r})
        out = {{}}
        for mt in {list(MODEL_TYPES)!r}:
            model = OLMo(ModelConfig(model_type=mt, **{fields!r})).eval()  # plain OLMo API, patched factory
            model.load_state_dict(torch.load({str(tmp_path)!r} + f"/{{mt}}.pt"), strict=True)
            with torch.no_grad():
                torch.save(model(ids).logits, {str(tmp_path)!r} + f"/{{mt}}-patched.pt")
            out[mt] = sorted(model.state_dict())  # parameters and saved buffers (prores's scale)
        import siamesenorm.models.registry as r
        import siamesenorm.models.olmo_hook as h
        out["factory_untouched"] = olmo.model.OLMoBlock.build.__func__ not in (r.hooked_build, h._trampoline)
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    env.pop("MODEL_TYPE", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("factory_untouched") is True  # the patch, not our runtime hook, built these blocks
    for mt in MODEL_TYPES:
        names = sorted(torch.load(tmp_path / f"{mt}.pt").keys())
        assert result[mt] == names
        torch.testing.assert_close(torch.load(tmp_path / f"{mt}-patched.pt"), expected[mt], rtol=0, atol=0)


def test_olmo_is_the_official_repository_as_a_submodule_at_v0_6_0():
    """.gitmodules and the index pin OLMo/ to the official repository's v0.6.0 commit (whose olmo/ is the sdist's)."""
    listed = subprocess.run(["git", "ls-files", "-s", "OLMo"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout:
        pytest.skip("not a git checkout of the project")
    mode, commit = listed.stdout.split()[:2]
    assert (mode, commit) == ("160000", olmo_patch.OFFICIAL_COMMIT)  # a gitlink: a submodule
    url = subprocess.run(["git", "config", "-f", ".gitmodules", "submodule.OLMo.url"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    assert url == olmo_patch.OFFICIAL_URL


@pytest.mark.slow
def test_an_empty_olmo_folder_is_filled_from_the_sdist_and_a_submodule_at_another_commit_is_refused(tmp_path):
    """A plain clone leaves OLMo/ empty (the submodule not initialised): setup fills it from the sdist. A submodule
    checkout elsewhere than v0.6.0 is refused in one line instead of patching the wrong source."""
    empty = tmp_path / "OLMo"
    empty.mkdir()
    tree = olmo_patch.materialize(empty, PATCH, CACHE)
    assert "SIAMESENORM_PATCHED = True" in (tree / "olmo" / "model.py").read_text()
    other = tmp_path / "sub" / "OLMo"
    other.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "--separate-git-dir", str(tmp_path / "sub" / "modules-OLMo"), str(other)],
                   check=True)
    (other / "README.md").write_text("not OLMo v0.6.0\n")
    subprocess.run([*git, "add", "-A"], cwd=other, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=other, check=True)
    assert olmo_patch.is_submodule_checkout(other)
    with pytest.raises(RuntimeError, match=r"submodule checkout at \w+, not v0.6.0 .*git submodule update OLMo"):
        olmo_patch.materialize(other, PATCH, CACHE)
    assert not (other / "olmo").exists()  # nothing written
