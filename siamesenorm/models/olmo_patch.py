"""The OLMo-source-tree route: the hook as edits to ai2-olmo 0.6.0's source, rendered into changes.patch.

The edits below are the one definition of the hook; ``changes.patch`` is generated from them
(``python scripts/olmo_tree.py patch``) and a test fails when the two disagree. Every variant itself stays in
this package: the patched factory calls ``siamesenorm.models.registry.block_for``.
"""

from __future__ import annotations

import difflib
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

VERSION = "0.6.0"
SDIST = f"ai2_olmo-{VERSION}.tar.gz"
SDIST_SHA256 = "17088d0b1c166aad60f4ebb6046100f2d70339ea910e075179aeb362f63560fc"
RELEASE_TAG = f"v{VERSION}"
#: OLMo/ as the git submodule .gitmodules declares: the official repository at its v0.6.0 tag. That commit's olmo/
#: is byte for byte the sdist's olmo/ (25 files), so changes.patch applies to either tree; the sdist holds the
#: package only (olmo/, hf_olmo/, olmo_data/), the repository everything else (scripts/, configs/, inference/...).
OFFICIAL_URL = "https://github.com/allenai/OLMo.git"
OFFICIAL_COMMIT = "6c3373fa182af2d57fe3c390ffc8420d5c5b325a"



def _config_fields() -> str:
    """SiameseModelConfig's fields, as lines of OLMo's ModelConfig (the patched tree has no SiameseModelConfig)."""
    import dataclasses
    import textwrap

    from olmo.config import ModelConfig

    from siamesenorm.models.config import SiameseModelConfig

    doc = textwrap.fill(  # no list of names here: a new variant must not make the patch stale
        "SiameseNorm: the block topology, one of siamesenorm.models.config.MODEL_TYPES (one file each under "
        "siamesenorm/variants/); the MODEL_TYPE environment variable overrides it. None means pre.",
        width=112,
        initial_indent="    ",
        subsequent_indent="    ",
    )
    lines = ["", "    model_type: Optional[str] = None", '    """', doc, '    """', ""]
    olmo_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for f in dataclasses.fields(SiameseModelConfig):
        if f.name not in olmo_fields and f.name != "model_type":
            default = f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)
            type_name = f.type if isinstance(f.type, str) else f.type.__name__
            lines.append(f"    {f.name}: {type_name} = {default}")
    return "\n".join(lines) + "\n"


def edits() -> list:
    """(file, anchor line, text inserted after the anchor), for each edit of the OLMo tree (a function: the config
    fields come from SiameseModelConfig, which imports OLMo)."""
    return [
        (
            "olmo/config.py",
            '    Apply norm after the attention/feedforward layers rather than before, as introduced in the Swin '
            'transformer paper (Liu et al).\n    """\n',
            _config_fields(),
        ),
        (
            "olmo/model.py",
            "log = logging.getLogger(__name__)\n",
            "\nSIAMESENORM_PATCHED = True  # OLMoBlock.build delegates to the siamesenorm package\n",
        ),
        (
            "olmo/model.py",
            "    def build(cls, layer_id: int, config: ModelConfig, cache: BufferCache) -> OLMoBlock:\n",
            """        # SiameseNorm: MODEL_TYPE / model.model_type choose the block; None means OLMo's own (pre).
        from siamesenorm.models.registry import block_for

        block = block_for(layer_id, config, cache)
        if block is not None:
            return block
""",
        ),
    ]


def patched_text(rel: str, original: str) -> str:
    text = original
    for path, anchor, insert in edits():
        if path != rel:
            continue
        if text.count(anchor) != 1:
            raise RuntimeError(f"{rel}: the anchor for the SiameseNorm hook is not unique or missing: {anchor!r}")
        text = text.replace(anchor, anchor + insert)
    return text


def render_patch(pristine_root: Path) -> str:
    """The unified diff (git-apply format) from the pristine OLMo source to the hooked one."""
    out = []
    for rel in sorted({path for path, _, _ in edits()}):
        before = (pristine_root / rel).read_text()
        after = patched_text(rel, before)
        out.append(f"diff --git a/{rel} b/{rel}\n")
        out.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{rel}", f"b/{rel}", n=3
            )
        )
    return "".join(out)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def fetch_sdist(cache_dir: Path) -> Path:
    """ai2-olmo 0.6.0's source distribution from PyPI (pip's cache serves reruns), checksum verified."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / SDIST
    if not path.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", f"ai2-olmo=={VERSION}", "-d", str(cache_dir)],
            check=True,
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest} is not ai2-olmo {VERSION}'s {SDIST_SHA256}; delete it and rerun.")
    return path


def is_submodule_checkout(target: Path) -> bool:
    """OLMo/ filled by ``git submodule update --init`` (its .git is a file pointing into the superproject)."""
    return (Path(target) / ".git").is_file()


def materialize(target: Path, patch_file: Optional[Path], cache_dir: Path) -> Path:
    """OLMo/ as a git repository: the pristine release committed and tagged, then ``patch_file`` applied and
    committed. Safe to rerun: an existing tree at the release tag is reused. An empty OLMo/ (the submodule not
    initialised, as in a plain clone) is filled from the sdist; a submodule checkout gets the patch applied in its
    working tree, uncommitted, as the official README does it (it must be at ``OFFICIAL_COMMIT``)."""
    target = Path(target)
    if is_submodule_checkout(target):
        head = _git(target, "rev-parse", "HEAD").strip()
        if head != OFFICIAL_COMMIT:
            raise RuntimeError(f"{target} is a submodule checkout at {head[:12]}, not v{VERSION} "
                               f"({OFFICIAL_COMMIT[:12]}); run `git submodule update {target.name}` and rerun.")
        if patch_file is not None and subprocess.run(["git", "apply", "--reverse", "--check", str(patch_file)],
                                                     cwd=target, capture_output=True).returncode != 0:
            _git(target, "checkout", "-q", OFFICIAL_COMMIT, "--", "olmo")
            _git(target, "apply", str(patch_file))
        return target
    if not (target / ".git").is_dir():
        sdist = fetch_sdist(cache_dir)
        if target.exists() and any(target.iterdir()):
            raise RuntimeError(f"{target} exists and is not our OLMo checkout; move it away and rerun.")
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            shutil.copytree(Path(tmp) / f"ai2_olmo-{VERSION}", target, dirs_exist_ok=True)
        _git(target, "init", "-q")
        _git(target, "add", "-A")
        _git(target, "-c", "user.name=siamesenorm", "-c", "user.email=siamesenorm@localhost",
             "commit", "-q", "-m", f"ai2-olmo {VERSION} (PyPI source distribution)")
        _git(target, "tag", RELEASE_TAG)
    if patch_file is not None:
        applied = subprocess.run(["git", "apply", "--reverse", "--check", str(patch_file)], cwd=target,
                                 capture_output=True).returncode == 0
        if not applied:
            _git(target, "checkout", "-q", RELEASE_TAG, "--", "olmo")
            _git(target, "apply", str(patch_file))
            _git(target, "-c", "user.name=siamesenorm", "-c", "user.email=siamesenorm@localhost",
                 "commit", "-q", "-am", "SiameseNorm: OLMoBlock.build delegates to siamesenorm (changes.patch)")
    return target


def pristine_tree(target: Path) -> Path:
    """A folder with the release's olmo/ sources, read from the checkout's release tag."""
    out = Path(tempfile.mkdtemp())
    for rel in sorted({path for path, _, _ in edits()}):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        release = OFFICIAL_COMMIT if is_submodule_checkout(target) else RELEASE_TAG
        (out / rel).write_text(_git(target, "show", f"{release}:{rel}"))
    return out
