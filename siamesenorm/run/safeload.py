"""Loading checkpoint files that may come from anyone: nothing in them runs, and nothing in them makes us allocate
more than the file itself holds.

Every checkpoint file this project opens, from every entry point (train --load_path and resume, FSDP rank files,
analyze, export, generate), goes through ``load``:

1. ``check_torch_file`` reads the torch zip archive and unpickles its ``data.pkl`` with an unpickler of our own
   whose ``find_class`` knows a fixed table of names (``_ALLOWED``) and returns, for each, an inert stand-in that
   only records its arguments: no class or function of the checkpoint's choosing is ever called. Python's unpickler
   asks ``find_class`` for every global however the pickle names it (GLOBAL, STACK_GLOBAL with strings from the
   memo, extension codes), so no naming trick gets past the table. The same pass checks every size against what
   the file holds: each archive member is stored uncompressed (a member cannot inflate), ``data.pkl`` is at most
   ``MAX_PICKLE_BYTES``, every storage's element count matches its member's bytes, every tensor view lies inside its
   storage and has no more elements than the storage (no stride-0 blow-up), every numpy array's shape matches its
   raw bytes, and every sharded tensor's global and shard sizes fit in the checkpoint's files together.
2. Only then does torch read the same open file with ``weights_only=True`` and this project's allow-list
   (``checkpoints.allow_checkpoint_types``): torch's own restricted unpickler, given bytes already checked.

OLMo's ``<name>.safetensors`` files (OLMo prefers them to ``.pt`` and names their tensors with pickles) are read by
``load_olmo_safetensors``: the names are unpickled by the same unpickler with no global allowed at all.
``checked_loads`` routes OLMo's own ``torch.load`` and safetensors calls through these while it restores or unshards.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import pickle
import pickletools
import stat
import struct
from collections import OrderedDict
from pathlib import Path, PosixPath
from typing import Any, BinaryIO, Callable, Dict, Optional

import numpy as np
import olmo.checkpoint as olmo_checkpoint
import torch
import torch.distributed.checkpoint.metadata as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo as TorchInfo

__all__ = ["UnsafeCheckpoint", "check_torch_file", "load", "allow_checkpoint_types", "sharded_limit",
           "load_olmo_safetensors", "checked_loads", "sharded_tensors_in_one_process", "unpickle_plain",
           "MAX_PICKLE_BYTES", "load_checkpoint_metadata", "checked_olmo_core_loads", "check_checkpoint_metadata",
           "refusal_inside", "prescan_pickle", "read_archive", "CHECK_BYTES_PER_PICKLE_BYTE"]

MAX_PICKLE_BYTES = 64 * 2**20  # a 1.3B model's FSDP rank file pickles to a few MB
MAX_DIMS = 64

_torch_load = torch.load  # the real one, also while checked_loads has replaced torch.load


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file was refused before anything in it was run or allocated; the message says why."""


class _Refused(Exception):
    pass


# ---- inert stand-ins ---------------------------------------------------------------------------------------------
class _Stub:
    """An instance of an allowed class: NEWOBJ / REDUCE / BUILD only record their arguments."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state


def _stub(name: str) -> type:
    return type(name, (_Stub,), {})


_SHARD_CLASSES = {
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": _stub("ShardedTensor"),
    "torch.distributed._shard.sharded_tensor.shard.Shard": _stub("Shard"),
    "torch.distributed._shard.metadata.ShardMetadata": _stub("ShardMetadata"),
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata": _stub("ShardedTensorMetadata"),
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties": _stub("TensorProperties"),
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": _stub("MEM_FORMAT_ENCODING"),
    "torch.distributed.remote_device._remote_device": _stub("_remote_device"),
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec": _stub("ChunkShardingSpec"),
    "torch.distributed._shard.sharding_spec.api.EnumerableShardingSpec": _stub("EnumerableShardingSpec"),
    "torch.distributed._shard.sharding_spec.api.DevicePlacementSpec": _stub("DevicePlacementSpec"),
}
_SHARDED = _SHARD_CLASSES["torch.distributed._shard.sharded_tensor.api.ShardedTensor"]
_MEM_FORMAT = _SHARD_CLASSES["torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING"]
_PROCESS_GROUP_STATE = _stub("ProcessGroupState")
_MEM_FORMATS = ("TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT")


class _NoBuild:
    """A stand-in that a pickle's BUILD may not act on. On a real tensor torch's reader answers BUILD with
    ``tensor.set_(*state)`` (a tuple's items, or a dict's keys), which re-views the tensor over any storage with any
    size and stride: the checked view would not be the loaded one. torch.save never writes a BUILD on a tensor or a
    storage (a tensor's attributes travel in _rebuild_from_type_v2's state argument)."""

    def __setstate__(self, state):
        raise _Refused(f"a BUILD step on a {self.what} (it would re-view the tensor after its check)")


class _StorageType(_NoBuild):
    what = "storage type"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Storage(_NoBuild):
    what = "tensor storage"

    def __init__(self, dtype: torch.dtype, numel: int):
        self.dtype, self.numel = dtype, numel


class _Tensor(_NoBuild):
    what = "tensor"

    def __init__(self, dtype: torch.dtype, shape: tuple):
        self.dtype, self.shape, self.state = dtype, shape, None


class _NumpyDType(_Stub):
    def __new__(cls, name=None, *args):
        if not isinstance(name, str) or name not in _NUMPY_DTYPES:
            raise _Refused(f"a numpy array of dtype {name!r} (only plain numbers are allowed)")
        obj = super().__new__(cls)
        obj.itemsize = np.dtype(name).itemsize
        return obj

    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) >= 5 and state[2] is None and state[3] is None
                and state[4] is None):
            raise _Refused("a numpy dtype with fields or sub-arrays")


class _NumpyArray(_Stub):
    def __setstate__(self, state):
        if not (isinstance(state, tuple) and len(state) == 5):
            raise _Refused("a numpy array with an unexpected state")
        _, shape, dtype, _, raw = state
        dims = _dims(shape, "numpy array shape")
        if not isinstance(dtype, _NumpyDType):
            raise _Refused("a numpy array without a plain dtype")
        if not isinstance(raw, (bytes, bytearray)):
            raise _Refused("a numpy array whose data are not raw bytes (object arrays are not allowed)")
        if math.prod(dims) * dtype.itemsize != len(raw):
            raise _Refused(f"a numpy array of shape {dims} with {len(raw)} bytes of data")


_NUMPY_DTYPES = {f"{k}{n}" for k in "iu" for n in (1, 2, 4, 8)} | {"f2", "f4", "f8", "b1", "c8", "c16"}


def _dims(value, what: str) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in value):
        raise _Refused(f"a {what} that is not a short list of non-negative integers")
    return tuple(value)


# ---- the unpickler -------------------------------------------------------------------------------------------------
class _Unpickler(pickle.Unpickler):
    """Knows only ``self.allowed``; storages come from ``self.storage`` (None: a pickle that may hold none)."""

    def __init__(self, data: bytes, allowed: Dict[str, Any], storage: Optional[Callable] = None):
        super().__init__(io.BytesIO(data))
        self.allowed, self.storage = allowed, storage

    def find_class(self, module: str, name: str):
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise _Refused(f"it refers to {full}, which is not on the checkpoint allow-list")
        return self.allowed[full]

    def persistent_load(self, pid):
        if self.storage is None:
            raise _Refused("a tensor storage where none may be")
        return self.storage(pid)


def _rebuild_tensor(storage, offset, size, stride, *rest):
    if not isinstance(storage, _Storage):
        raise _Refused("a tensor without a storage of this file")
    dims, strides = _dims(size, "tensor size"), _dims(stride, "tensor stride")
    if len(dims) != len(strides) or not isinstance(offset, int) or offset < 0:
        raise _Refused("a tensor whose size, stride and offset disagree")
    numel = math.prod(dims)
    if numel > storage.numel:
        raise _Refused(f"a tensor of {numel:,d} elements viewing a storage of {storage.numel:,d}")
    if numel and offset + sum((d - 1) * s for d, s in zip(dims, strides)) >= storage.numel:
        raise _Refused("a tensor that reaches past the end of its storage")
    hooks = rest[1] if len(rest) > 1 else None
    if hooks:
        raise _Refused("a tensor with backward hooks")
    return _Tensor(storage.dtype, dims)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    if not isinstance(data, _Tensor) or hooks:
        raise _Refused("a parameter that is not a plain tensor")
    return data


class _ShardedBound:
    """The most elements a sharded tensor may claim: what all the checkpoint's files hold together, in bytes."""

    def __init__(self, limit: int):
        self.limit = limit

    def check(self, dims: tuple, what: str) -> None:
        if math.prod(dims) > self.limit:
            raise _Refused(f"a {what} of {math.prod(dims):,d} elements, more than the checkpoint's files hold")


def _torch_allowed(bound: _ShardedBound) -> Dict[str, Any]:
    def wrapper_subclass(cls, dtype, size, *rest):
        if cls is not _SHARDED or not isinstance(dtype, torch.dtype):
            raise _Refused("a tensor subclass other than FSDP's ShardedTensor")
        dims = _dims(size, "sharded tensor size")
        bound.check(dims, "sharded tensor")
        return _Tensor(dtype, dims)

    def from_type(func, new_type, args, state):
        if func not in (_rebuild_tensor, wrapper_subclass, _rebuild_parameter) or new_type not in (_TENSOR, _SHARDED):
            raise _Refused("a tensor rebuilt in an unknown way")
        if not isinstance(args, tuple):
            raise _Refused("a tensor rebuilt from arguments that are not a tuple")
        if new_type is _TENSOR and state is not None and not (
                isinstance(state, dict) and all(isinstance(k, str) and k not in _TENSOR_INTERNALS
                                                and isinstance(v, (bool, int, float, str, type(None)))
                                                for k, v in state.items())):
            # a plain tensor's state is set attribute by attribute: plain flags (FSDP writes _has_been_cloned) are
            # fine; ``data``, ``grad`` and the like would put a second view in place of the checked one
            raise _Refused("a plain tensor whose state sets more than plain attributes after its rebuild")
        tensor = func(*args)
        if not isinstance(tensor, _Tensor):
            raise _Refused("a tensor rebuilt as something else")
        tensor.state = state
        return tensor

    def restricted_getattr(obj, name):
        if obj is _MEM_FORMAT and name in _MEM_FORMATS:
            return name
        if obj is _SHARDED and name == "ProcessGroupState":
            return _PROCESS_GROUP_STATE
        raise _Refused(f"an attribute look-up ({name!r}) that is not on the checkpoint allow-list")

    def layout(name):
        if name != "torch.strided":
            raise _Refused(f"a tensor layout {name!r}")
        return name

    def device(spec, *rest):
        if not isinstance(spec, (str, int)):
            raise _Refused("a device that is not a name")
        return str(spec)

    def size(dims=()):
        return _dims(dims, "size")

    allowed = {
        "collections.OrderedDict": OrderedDict,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_wrapper_subclass": wrapper_subclass,
        "torch._tensor._rebuild_from_type_v2": from_type,
        "torch.Tensor": _TENSOR,
        "torch.Size": size,
        "torch.device": device,
        "torch.serialization._get_layout": layout,
        "builtins.getattr": restricted_getattr,
        "pathlib.PosixPath": _path,
        **_SHARD_CLASSES,
        **_numpy_allowed(),
        "_codecs.encode": _encode,
    }
    for dtype in _TORCH_DTYPES:
        allowed[str(dtype)] = dtype
        storage = _STORAGE_NAMES.get(dtype)
        if storage:
            allowed[f"torch.{storage}"] = _StorageType(dtype)
    return allowed


_TENSOR = object()  # torch.Tensor as _rebuild_from_type_v2's new_type
#: Attributes a plain tensor's saved state may not set (each replaces what the tensor is or holds).
_TENSOR_INTERNALS = frozenset({"data", "grad", "_grad", "_base", "_backward_hooks", "_post_accumulate_grad_hooks",
                               "_grad_fn", "requires_grad", "_cdata", "__class__", "__dict__"})
_TORCH_DTYPES = [getattr(torch, n) for n in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                                             "int8", "uint8", "bool", "complex64", "complex128")]
_STORAGE_NAMES = {torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
                  torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
                  torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
                  torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage",
                  torch.complex128: "ComplexDoubleStorage"}


def _path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise _Refused("a path made of something other than text")
    return "/".join(parts)


def _encode(text, encoding="utf-8"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused("a bytes object in an unexpected encoding")
    return text.encode("latin1")


def _numpy_allowed() -> Dict[str, Any]:
    ndarray = object()

    def reconstruct(cls, shape=(0,), typecode=b"b"):
        if cls is not ndarray:
            raise _Refused("numpy's _reconstruct of something other than an ndarray")
        return _NumpyArray()

    def scalar(dtype, raw=b""):
        if not isinstance(dtype, _NumpyDType) or not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
            raise _Refused("a numpy scalar that is not a plain number")
        return 0

    out = {}
    for core in ("numpy.core", "numpy._core"):  # numpy 1 and numpy 2 name their core module differently
        out[f"{core}.multiarray._reconstruct"] = reconstruct
        out[f"{core}.multiarray.scalar"] = scalar
    out["numpy.ndarray"] = ndarray
    out["numpy.dtype"] = _NumpyDType
    return out


def _walk_shards(root: Any, bound: _ShardedBound) -> None:
    """Sizes in sharded-tensor metadata (OLMo's unshard allocates from them) against the checkpoint's bytes."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, bytearray, int, float, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, _Stub):
            state = obj.state if isinstance(obj.state, dict) else {}
            if isinstance(obj.state, tuple) and len(obj.state) == 2:  # (__dict__, __slots__ values)
                state = {k: v for part in obj.state if isinstance(part, dict) for k, v in part.items()}
            name = type(obj).__name__
            if name == "ShardMetadata":
                for key in ("shard_sizes", "shard_offsets"):
                    if key in state:
                        dims = _dims(state[key], key)
                        bound.check(dims if key == "shard_sizes" else (max(dims, default=0),), key)
            elif name == "ShardedTensorMetadata" and "size" in state:
                bound.check(_dims(state["size"], "sharded tensor size"), "sharded tensor")
            stack.extend(obj.args)
            stack.append(obj.state)
        elif isinstance(obj, _Tensor):
            stack.append(obj.state)


# ---- torch zip archives --------------------------------------------------------------------------------------------
# One reading of the archive, the one torch's reader (miniz) makes: the end record in the file's last 22 bytes (a
# zip64 locator and end record right before it when present), the central directory at the offset those records
# give (no "prepended data" adjustment, which Python's zipfile makes and miniz does not), and each member's data
# after its local header. The members, the central directory and the end records must tile the file exactly, from
# byte 0 to the last, so no second archive can hide in a gap, an overlap, a comment or trailing bytes: every byte
# torch reads is a byte checked here.
_EOCD = struct.Struct("<4sHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
MAX_CENTRAL_BYTES = 64 * 2**20  # about 600,000 members


def _zip64_fields(extra: bytes, wanted: int) -> list:
    """The first ``wanted`` 8-byte values of a zip64 extended-information field (header 0x0001) in ``extra``."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            if length < 8 * wanted or pos + 4 + length > len(extra):
                raise _Refused("an archive with a zip64 field too short for its sizes")
            return list(struct.unpack_from(f"<{wanted}Q", extra, pos + 4))
        pos += 4 + length
    raise _Refused("an archive whose sizes point to a zip64 field that is not there")


def read_archive(file: BinaryIO, size: int) -> Dict[str, tuple]:
    """{member name: (offset of its data, its size)} of a torch zip archive, refused unless unambiguous (above)."""
    if size < _EOCD.size:
        raise _Refused("it is not a torch checkpoint (not a zip archive)")
    file.seek(size - _EOCD.size)
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment = _EOCD.unpack(file.read(_EOCD.size))
    if sig != b"PK\x05\x06":
        raise _Refused("it is not a torch checkpoint (not a zip archive that ends with its end record, as torch "
                       "writes them: no comment, nothing after it)")
    if comment:
        raise _Refused("an archive with a comment (torch writes none)")
    end_of_cd = size - _EOCD.size
    if end_of_cd >= _ZIP64_LOCATOR.size + _ZIP64_EOCD.size:
        file.seek(end_of_cd - _ZIP64_LOCATOR.size)
        lsig, ldisk, z_offset, _disks = _ZIP64_LOCATOR.unpack(file.read(_ZIP64_LOCATOR.size))
        if lsig == b"PK\x06\x07":
            if ldisk != 0 or z_offset != end_of_cd - _ZIP64_LOCATOR.size - _ZIP64_EOCD.size:
                raise _Refused("an archive whose zip64 end record is not right before its locator")
            file.seek(z_offset)
            (zsig, rec_size, _, _, zdisk, zcd_disk, zn_disk, zn_total, zcd_size,
             zcd_offset) = _ZIP64_EOCD.unpack(file.read(_ZIP64_EOCD.size))
            if zsig != b"PK\x06\x06" or rec_size != _ZIP64_EOCD.size - 12:
                raise _Refused("an archive with a malformed zip64 end record")
            for short, full, mask in ((disk, zdisk, 0xFFFF), (cd_disk, zcd_disk, 0xFFFF), (n_disk, zn_disk, 0xFFFF),
                                      (n_total, zn_total, 0xFFFF), (cd_size, zcd_size, 0xFFFFFFFF),
                                      (cd_offset, zcd_offset, 0xFFFFFFFF)):
                if short not in (full, mask):
                    raise _Refused("an archive whose two end records disagree")
            disk, cd_disk, n_disk, n_total, cd_size, cd_offset = zdisk, zcd_disk, zn_disk, zn_total, zcd_size, zcd_offset
            end_of_cd = z_offset
    if disk or cd_disk or n_disk != n_total:
        raise _Refused("a multi-part archive")
    if cd_offset + cd_size != end_of_cd:
        raise _Refused("an archive with bytes between its central directory and its end record, or before its "
                       "first member (two readers would see two archives)")
    if cd_size > MAX_CENTRAL_BYTES or n_total * _CENTRAL.size > cd_size:
        raise _Refused(f"an archive whose central directory claims {n_total:,d} members in {cd_size:,d} bytes")
    file.seek(cd_offset)
    central = file.read(cd_size)
    entries, pos, lowered = [], 0, set()
    for _ in range(n_total):
        if pos + _CENTRAL.size > len(central):
            raise _Refused("an archive whose central directory is cut short")
        (csig, _, _, flags, method, _, _, _, csize, usize, nlen, elen, clen, _, _, _,
         local) = _CENTRAL.unpack_from(central, pos)
        name = central[pos + _CENTRAL.size:pos + _CENTRAL.size + nlen]
        extra = central[pos + _CENTRAL.size + nlen:pos + _CENTRAL.size + nlen + elen]
        pos += _CENTRAL.size + nlen + elen + clen
        if csig != b"PK\x01\x02" or pos > len(central):
            raise _Refused("an archive with a malformed central directory")
        wide = [v for v in (usize, csize, local) if v == 0xFFFFFFFF]
        if wide:
            values = iter(_zip64_fields(extra, len(wide)))
            usize, csize, local = (next(values) if v == 0xFFFFFFFF else v for v in (usize, csize, local))
        try:
            text = name.decode("ascii")
        except UnicodeDecodeError:
            raise _Refused("an archive with a member name that is not ASCII") from None
        if method != 0 or csize != usize:
            raise _Refused(f"a compressed member {text} (torch stores every member uncompressed)")
        if flags & 0x41:
            raise _Refused(f"an encrypted member {text}")
        if text.lower() in lowered:  # torch's reader looks names up without regard to case
            raise _Refused("an archive with two members of the same name")
        lowered.add(text.lower())
        entries.append((local, text, name, flags, usize))
    if pos != len(central):
        raise _Refused("an archive whose central directory holds more than its members")
    members: Dict[str, tuple] = {}
    at = 0
    entries.sort()
    for i, (local, text, name, flags, usize) in enumerate(entries):
        if local != at:
            raise _Refused(f"an archive with bytes before, between or shared by its members (at {at:,d}; {text} at "
                           f"{local:,d})")
        file.seek(local)
        header = file.read(_LOCAL.size)
        if len(header) < _LOCAL.size:
            raise _Refused("an archive cut short")
        lsig, _, lflags, lmethod, _, _, _, _, _, lnlen, lelen = _LOCAL.unpack(header)
        if lsig != b"PK\x03\x04" or lmethod != 0 or lflags != flags or file.read(lnlen) != name:
            raise _Refused(f"an archive whose local header of {text} disagrees with its central directory")
        start = local + _LOCAL.size + lnlen + lelen
        at = start + usize
        if at > cd_offset:
            raise _Refused(f"a member {text} that runs into the central directory")
        if flags & 0x08:  # a data descriptor follows: [signature] crc, sizes (4 or 8 bytes each) equal to usize
            following = entries[i + 1][0] if i + 1 < len(entries) else cd_offset
            file.seek(at)
            tail = file.read(24)
            sig = 4 if tail[:4] == b"PK\x07\x08" else 0
            lengths = {sig + 4 + 2 * w for w, fmt in ((4, "<2I"), (8, "<2Q"))
                       if len(tail) >= sig + 4 + 2 * w and struct.unpack_from(fmt, tail, sig + 4) == (usize, usize)}
            if following - at not in lengths:
                raise _Refused(f"an archive with bytes after member {text} that are not its data descriptor")
            at = following
        members[text] = (start, usize)
    if at != cd_offset:
        raise _Refused("an archive with bytes between its last member and its central directory")
    return members


def _archive_prefix(names: list) -> str:
    if not names:
        raise _Refused("an empty archive")
    prefix = names[0].split("/", 1)[0]
    if any(not n.startswith(prefix + "/") for n in names):
        raise _Refused("an archive whose members are not in one folder")
    if f"{prefix}/data.pkl" not in names:
        raise _Refused("no data.pkl in the archive")
    return prefix


def check_torch_file(file: BinaryIO, name: str, sharded_limit: Optional[int] = None) -> None:
    """Raise UnsafeCheckpoint (naming ``name``) unless ``file`` is a torch checkpoint made only of what the allow-list
    names, with every size within what the file holds (module docstring). Reads the file; allocates at most its
    pickle and ``CHECK_BYTES_PER_PICKLE_BYTE`` times its size. ``sharded_limit``: the bytes a sharded tensor may
    claim (default: this file's size)."""
    try:
        file.seek(0, io.SEEK_END)
        size = file.tell()
        members = read_archive(file, size)
        names = sorted(members, key=lambda n: members[n][0])  # torch's archive folder: the first member's
        prefix = _archive_prefix(names)
        start, length = members[f"{prefix}/data.pkl"]
        if length > MAX_PICKLE_BYTES:
            raise _Refused(f"its pickle has {length:,d} bytes (at most {MAX_PICKLE_BYTES:,d})")
        file.seek(start)
        data = file.read(length)
        prescan_pickle(data)
        storages: Dict[str, _Storage] = {}

        def storage(pid):
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                    and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                    and isinstance(pid[4], int) and pid[4] >= 0):
                raise _Refused("a tensor storage reference of an unknown form")
            _, kind, key, _, numel = pid
            member = f"{prefix}/data/{key}"
            if member not in members:
                raise _Refused(f"a storage {key!r} that the archive does not hold")
            stored = members[member][1]
            if stored != numel * kind.dtype.itemsize:
                raise _Refused(f"storage {key!r} claims {numel:,d} elements of {kind.dtype} but holds {stored:,d} "
                               "bytes")
            found = storages.setdefault(key, _Storage(kind.dtype, numel))
            if found.dtype != kind.dtype or found.numel != numel:
                raise _Refused(f"storage {key!r} is used with two different types")
            return found

        bound = _ShardedBound(sharded_limit if sharded_limit is not None else size)
        result = _Unpickler(data, _torch_allowed(bound), storage).load()
        _walk_shards(result, bound)
    except _Refused as why:
        raise UnsafeCheckpoint(f"refusing to load {name}: {why}; nothing in it was run. Use checkpoints written by "
                               "this project's training, or convert the file where you trust it.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, OverflowError, MemoryError, UnicodeDecodeError, struct.error) as err:
        raise UnsafeCheckpoint(f"refusing to load {name}: it is not a readable torch checkpoint "
                               f"({type(err).__name__}: {_plain(err)}); nothing in it was run.") from None


# ---- the checker's own memory --------------------------------------------------------------------------------------
#: What one opcode may cost the unpickler that runs after this scan, in bytes, by what it makes: a stack slot for
#: anything it pushes (48: also covers the object's slot in a dict or list it later moves into), plus the object.
#: Each is above what tracemalloc measures for a pickle made of that opcode alone (an empty dict a byte: 89 bytes
#: a byte; a stand-in made by REDUCE: 28 bytes a byte of its four opcodes), so their sum bounds the checker.
_OP_COST = {**{op: 8 for op in ("NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "MARK", "POP", "POP_MARK", "FRAME",
                                "PROTO", "STOP", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS")},
            **{op: 16 for op in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")},  # a memo slot, doubled on growth
            **{op: 48 + 112 for op in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "DICT", "LIST", "TUPLE", "TUPLE1",
                                       "TUPLE2", "TUPLE3", "FROZENSET")},
            **{op: 48 + 128 for op in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "GLOBAL", "STACK_GLOBAL",
                                       "BINPERSID", "PERSID", "INST", "OBJ", "EXT1", "EXT2", "EXT4")}}
#: The most the checker may spend a byte of pickle (``prescan_pickle``). Pickles torch and OLMo write cost 9-25
#: (tests/run/test_untrusted.py measures them); a pickle of the cheapest object-making opcodes would cost 160.
CHECK_BYTES_PER_PICKLE_BYTE = 96


def prescan_pickle(data: bytes) -> None:
    """Before any unpickling: the memo is dense (an index is at most one past the highest before it, so the C
    unpickler's memo array stays within twice the number of memo writes) and what the opcodes make is within
    ``CHECK_BYTES_PER_PICKLE_BYTE`` times the pickle's size. Streams the opcodes; keeps nothing of them."""
    cost, memo = 0, 0
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            if arg > memo:
                raise _Refused(f"a memo index {arg:,d} beyond the {memo:,d} objects stored before it")
            memo = max(memo, arg + 1)
        elif name == "MEMOIZE":
            memo += 1
        elif name in ("GET", "BINGET", "LONG_BINGET") and arg >= memo:
            raise _Refused(f"a memo index {arg:,d} that nothing was stored under")
        if isinstance(arg, (str, bytes, bytearray)):
            cost += 48 + 64 + 2 * len(arg)
        elif isinstance(arg, int) and not isinstance(arg, bool) and name.startswith("LONG") and "GET" not in name \
                and "PUT" not in name:
            cost += 48 + 32 + arg.bit_length() // 8
        else:
            cost += _OP_COST.get(name, 48 + 32)
    if cost > CHECK_BYTES_PER_PICKLE_BYTE * len(data):
        raise _Refused(f"a pickle of {len(data):,d} bytes whose opcodes would make about {cost:,d} bytes of objects "
                       f"(at most {CHECK_BYTES_PER_PICKLE_BYTE} a byte)")


def _plain(err: BaseException) -> str:
    """An exception's text, one line of at most 120 characters, with no advice to turn a safety check off."""
    text = " ".join(str(err).split())
    if "weights_only" in text or "trust_remote_code" in text or "safe_globals" in text:
        return "refused by torch's restricted reader"
    return text[:120]


def sharded_limit(path: Path) -> int:
    """What a sharded tensor in ``path`` may claim: the bytes of all the rank files beside it (or its own)."""
    ranks = list(path.parent.glob("rank*.pt"))
    if path in ranks or path.name.startswith("rank"):
        return sum(p.stat().st_size for p in ranks)
    return path.stat().st_size


def load(path, map_location=None, **_ignored):
    """``torch.load`` for untrusted files: ``check_torch_file`` first, then torch with ``weights_only=True`` on the same
    open file. ``path`` may be a path or a binary file object."""
    allow_checkpoint_types()
    if isinstance(path, (str, Path)):
        path = Path(path)
        with open(path, "rb") as f:
            check_torch_file(f, str(path), sharded_limit(path))
            return _second_read(f, str(path), map_location)
    name = str(getattr(path, "name", "a checkpoint stream"))
    check_torch_file(path, name)
    return _second_read(path, name, map_location)


def _second_read(file: BinaryIO, name: str, map_location):
    """torch's own read of a checked file; whatever it refuses is the same one-line refusal (torch's text advises
    ``weights_only=False``, which this project never suggests)."""
    file.seek(0)
    try:
        return _torch_load(file, map_location=map_location, weights_only=True)
    except Exception as err:  # torch's reader raises several classes (UnpicklingError, RuntimeError, ...)
        raise UnsafeCheckpoint(f"refusing to load {name}: torch's restricted reader refused it after our check "
                               f"({type(err).__name__}: {_plain(err)}); nothing in it was run.") from None


# ---- torch's own allow-list, for the second read -------------------------------------------------------------------
def _sharded_tensor_types() -> tuple:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        DevicePlacementSpec,
        EnumerableShardingSpec,
    )
    from torch.distributed.remote_device import _remote_device

    # the sharding specs are plain dataclasses; which one a shard holds depends on how FSDP split the parameter
    return (ShardedTensor, ShardedTensor.ProcessGroupState, Shard, ShardMetadata, ShardedTensorMetadata,
            TensorProperties, MEM_FORMAT_ENCODING, _remote_device, ChunkShardingSpec, EnumerableShardingSpec,
            DevicePlacementSpec)


def _checkpoint_getattr(obj, name: str):
    """The only attribute look-ups a checkpoint may make while unpickling: an enum member of the sharded-tensor
    metadata and ShardedTensor's ProcessGroupState (both written by pickling FSDP's torch_legacy shards)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING

    if obj is MEM_FORMAT_ENCODING and name in MEM_FORMAT_ENCODING.__members__:
        return MEM_FORMAT_ENCODING[name]
    if obj is ShardedTensor and name == "ProcessGroupState":
        return ShardedTensor.ProcessGroupState
    raise pickle.UnpicklingError(f"attribute {name!r} of {obj!r} is not on the checkpoint allow-list")


def allow_checkpoint_types() -> None:
    """Let torch.load with weights_only=True (torch's default) read what OLMo's trainer writes, and nothing more:
    the trainer state's paths and numpy RNG state, and FSDP's sharded tensors. Idempotent."""
    torch.serialization.add_safe_globals(
        [
            PosixPath,
            np.core.multiarray._reconstruct,
            np.ndarray,
            np.dtype,
            *{type(np.dtype(name)) for name in sorted(_NUMPY_DTYPES)},  # what check_torch_file accepts
            *_sharded_tensor_types(),
            (_checkpoint_getattr, "builtins.getattr"),
        ]
    )


# ---- pickles outside torch archives: OLMo's safetensors names ------------------------------------------------------
def unpickle_plain(data: bytes, what: str) -> Any:
    """A pickle of plain data only (str, numbers, tuples, lists, dicts): no global is allowed at all."""
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafeCheckpoint(f"refusing to load {what}: a pickle of {len(data):,d} bytes")
    try:
        return _Unpickler(data, {}).load()
    except _Refused as why:
        raise UnsafeCheckpoint(f"refusing to load {what}: {why}; nothing in it was run.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, RecursionError, MemoryError, KeyError,
            IndexError, UnicodeDecodeError) as err:
        raise UnsafeCheckpoint(f"refusing to load {what}: a name that is not a readable pickle "
                               f"({type(err).__name__}); nothing in it was run.") from None


def load_olmo_safetensors(filename, map_location: Optional[str] = None) -> Dict:
    """OLMo's ``<name>.safetensors`` format without running anything: each tensor's name is a pickled
    ``((key, ...), value_is_pickled)``, read as plain data; a value stored as a pickle must be plain data too."""
    import safetensors.torch

    filename = str(filename)
    try:
        flat = safetensors.torch.load_file(filename, device=map_location or "cpu")
    except Exception as err:  # safetensors' own errors (a bad header, a short file) are not one class
        raise UnsafeCheckpoint(f"refusing to load {filename}: not a readable safetensors file ({str(err)[:120]})") \
            from None
    result: Dict = {}
    for encoded, value in flat.items():
        try:
            raw = base64.urlsafe_b64decode(encoded)
        except ValueError:
            raise UnsafeCheckpoint(f"refusing to load {filename}: a tensor name that is not OLMo's encoding") from None
        key = unpickle_plain(raw, filename)
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple) and key[0]
                and all(isinstance(k, (str, int)) for k in key[0]) and isinstance(key[1], bool)):
            raise UnsafeCheckpoint(f"refusing to load {filename}: a tensor name that is not OLMo's encoding")
        keys, pickled = key
        if pickled:
            value = unpickle_plain(value.numpy().tobytes(), filename)
        target = result
        for k in keys[:-1]:
            target = target.setdefault(k, {})
            if not isinstance(target, dict):
                raise UnsafeCheckpoint(f"refusing to load {filename}: tensor names that overlap")
        target[keys[-1]] = value
    return result


@contextlib.contextmanager
def sharded_tensors_in_one_process():
    """Let FSDP's ShardedTensors unpickle without a process group (unsharding in one process): their state is kept as
    saved instead of being checked against the group. torch's weights_only reader calls the class's __setstate__
    (OLMo patches torch._tensor._rebuild_from_type_v2 for this, which torch's cached allow-list no longer sees after
    the first load in a process)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    def keep_state(self, state):
        self._local_shards, self._metadata, _, self._sharding_spec, self._init_rrefs = state
        self._sharded_tensor_id = None

    saved = ShardedTensor.__setstate__
    ShardedTensor.__setstate__ = keep_state
    try:
        yield
    finally:
        ShardedTensor.__setstate__ = saved


@contextlib.contextmanager
def checked_loads():
    """While OLMo restores or unshards a checkpoint: its ``torch.load`` calls go through ``load`` and its safetensors
    reads through ``load_olmo_safetensors``."""
    with _swapped((torch, "load", load), (olmo_checkpoint, "safetensors_file_to_state_dict", load_olmo_safetensors)):
        yield


@contextlib.contextmanager
def _swapped(*swaps):
    """Each (object, attribute, replacement) set for the duration, then put back."""
    saved = [getattr(owner, name) for owner, name, _ in swaps]
    for owner, name, replacement in swaps:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(swaps, saved):
            setattr(owner, name, value)


#: What an OLMo-core / torch distributed checkpoint's ``.metadata`` pickle may name: the metadata classes of
#: torch.distributed.checkpoint, OLMo-core's storage record, torch.Size, dtypes and layouts. Nothing else resolves.
_DCP_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "ChunkStorageMetadata", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "olmo_core.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",) + tuple(str(d).split(".")[1] for d in _TORCH_DTYPES),
    "collections": ("OrderedDict",),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _DCP_METADATA_NAMES.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        raise _Refused(f"it refers to {module}.{name}, which is not on the checkpoint-metadata allow-list")


def load_checkpoint_metadata(file: BinaryIO, name: Optional[str] = None):
    """A distributed checkpoint's ``.metadata`` (a pickle written by torch.distributed.checkpoint), unpickled with
    only the metadata classes allowed (``_DCP_METADATA_NAMES``) and at most ``MAX_PICKLE_BYTES`` read, then checked
    field by field (``check_checkpoint_metadata``; the reader checks the files it names, ``checked_olmo_core_loads``)."""
    name = name or str(getattr(file, "name", "a checkpoint's .metadata"))
    data = file.read(MAX_PICKLE_BYTES + 1)
    try:
        if len(data) > MAX_PICKLE_BYTES:
            raise _Refused(f"it is larger than {MAX_PICKLE_BYTES:,d} bytes")
        prescan_pickle(data)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        check_checkpoint_metadata(metadata)
        return metadata
    except _Refused as why:
        raise UnsafeCheckpoint(f"refusing to load {name}: {why}; nothing in it was run.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, UnicodeDecodeError, OverflowError) as err:
        raise UnsafeCheckpoint(f"refusing to load {name}: it is not a readable checkpoint metadata file "
                               f"({type(err).__name__}: {_plain(err)}); nothing in it was run.") from None


MAX_CHECKPOINT_ITEMS = 10_000_000


def check_checkpoint_metadata(metadata: Any, folder: Optional[Path] = None) -> None:
    """Raise _Refused unless ``metadata`` is a ``torch.distributed.checkpoint`` Metadata whose every field has its
    type, whose tensor chunks lie inside their tensors, and whose every storage entry names a file by a plain name
    with a non-negative offset and length; with ``folder`` (a local checkpoint), a regular file inside ``folder``
    (no link out, no device or FIFO) with the offset and length inside it, and no tensor larger than the files.
    Only then does OLMo-core's reader open a file or read a byte that the metadata names."""
    from olmo_core.distributed.checkpoint.filesystem import _StorageInfo as CoreInfo

    if type(metadata) is not dcp.Metadata:
        raise _Refused(f"its metadata is a {type(metadata).__name__}, not a checkpoint's Metadata")
    items, storage = metadata.state_dict_metadata, metadata.storage_data
    if type(items) is not dict or type(storage) is not dict or len(items) + len(storage) > MAX_CHECKPOINT_ITEMS:
        raise _Refused("its metadata's item tables are not tables of a checkpoint's size")
    if not (metadata.planner_data is None or type(metadata.planner_data) is dict):
        raise _Refused("its metadata's planner data is not a table")
    for key, value in (metadata.planner_data or {}).items():
        if type(key) is not str or not (type(value) is tuple and all(type(v) in (str, int) for v in value)):
            raise _Refused(f"its planner entry {str(key)[:80]!r} is not a path of names")
    if not (metadata.storage_meta is None or type(metadata.storage_meta) is dcp.StorageMeta) or not (
            metadata.version is None or type(metadata.version) is str):
        raise _Refused("its metadata's storage record or version is of the wrong type")
    root = folder.resolve() if folder is not None else None
    sizes: Dict[str, int] = {}
    for index, info in storage.items():
        if type(index) is not dcp.MetadataIndex or type(info) not in (CoreInfo, TorchInfo):
            raise _Refused("a storage entry that is not a (MetadataIndex, _StorageInfo) pair")
        path, offset, length = info.relative_path, info.offset, info.length
        if type(path) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _Refused(f"a storage entry of {str(index.fqn)[:80]!r} with a path, offset or length of the wrong "
                           "type or sign")
        if path in sizes:
            pass
        elif "\0" in path or "/" in path or "\\" in path or path in ("", ".", ".."):
            raise _Refused(f"a storage entry that names {path[:120]!r}, outside the checkpoint folder")
        elif folder is None:
            sizes[path] = -1  # a remote folder: the name is plain; the byte range is what the reader asks for
        else:
            target = (root / path).resolve()
            if not target.is_relative_to(root) or target == root:
                raise _Refused(f"a storage entry that names {path[:120]!r}, outside the checkpoint folder")
            try:
                mode = target.stat()
            except OSError:
                raise _Refused(f"a storage entry that names {path[:120]!r}, which the folder does not hold") from None
            if not stat.S_ISREG(mode.st_mode):
                raise _Refused(f"a storage entry that names {path[:120]!r}, which is not a regular file")
            sizes[path] = mode.st_size
        if sizes[path] >= 0 and offset + length > sizes[path]:
            raise _Refused(f"a storage entry that reads bytes {offset:,d}-{offset + length:,d} of {path!r}, which "
                           f"holds {sizes[path]:,d} (a cut or altered file)")
    total = sum(sizes.values())
    for key, item in items.items():
        if type(key) is not str:
            raise _Refused("an item name that is not text")
        if type(item) is dcp.BytesStorageMetadata:
            continue
        if type(item) is not dcp.TensorStorageMetadata or type(item.properties) is not dcp.TensorProperties \
                or item.properties.dtype not in _TORCH_DTYPES or type(item.chunks) is not list:
            raise _Refused(f"item {key[:80]!r} is not a plain tensor's metadata")
        dims = _dims(item.size, "tensor size")
        if folder is not None and math.prod(dims) * item.properties.dtype.itemsize > total:
            raise _Refused(f"item {key[:80]!r} claims {math.prod(dims):,d} elements, more than the folder's files "
                           "hold")
        for chunk in item.chunks:
            if type(chunk) is not dcp.ChunkStorageMetadata:
                raise _Refused(f"item {key[:80]!r} has a chunk that is not a chunk")
            offsets, extent = _dims(chunk.offsets, "chunk offset"), _dims(chunk.sizes, "chunk size")
            if not (len(offsets) == len(extent) == len(dims)) or any(o + e > d for o, e, d in
                                                                     zip(offsets, extent, dims)):
                raise _Refused(f"item {key[:80]!r} has a chunk outside its tensor")


@contextlib.contextmanager
def checked_olmo_core_loads():
    """While OLMo-core's Trainer restores a checkpoint: every ``torch.load`` (the trainer state of each rank, every
    tensor and bytes item of the distributed checkpoint; OLMo-core and torch call it with ``weights_only=False``)
    goes through ``load``, the ``.metadata`` pickle through ``load_checkpoint_metadata`` (its storage entries
    checked against the folder before any is opened), and each item's bytes are checked where they are read, so a
    refusal names the file and the byte range."""
    import olmo_core.distributed.checkpoint.filesystem as core_fs

    class _Pickle:  # what OLMo-core's checkpoint reader calls as ``pickle``
        dump = staticmethod(pickle.dump)
        load = staticmethod(load_checkpoint_metadata)

    from olmo_core.io import is_url

    reader = core_fs.RemoteFileSystemReader
    original_content, original_metadata, original_read = (reader._get_content_for_read, reader.read_metadata,
                                                          reader.read_data)

    def checked_metadata(self):
        metadata = original_metadata(self)
        local = not is_url(str(self.path))
        try:
            check_checkpoint_metadata(metadata, Path(self.path) if local else None)
        except _Refused as why:
            raise UnsafeCheckpoint(f"refusing to load {self.path}/.metadata: {why}; nothing in it was run.") from None
        return metadata

    def checked_read(self, plan, planner):
        if not is_url(str(self.path)):  # local files one at a time: a refusal stops the reading without a thread
            self.thread_count = 0       # left to fail on the closed pool
        return original_read(self, plan, planner)

    def checked_content(self, read_item):
        item, content = original_content(self, read_item)
        info = self.storage_data[read_item.storage_index]
        check_torch_file(io.BytesIO(content), f"{self.path}/{info.relative_path} (bytes {info.offset:,d}-"
                                              f"{info.offset + info.length:,d}, item {read_item.storage_index.fqn})")
        return item, content

    with _swapped((torch, "load", load), (core_fs, "pickle", _Pickle), (reader, "_get_content_for_read",
                                                                        checked_content),
                  (reader, "read_metadata", checked_metadata), (reader, "read_data", checked_read)):
        yield


def errors_within(error: BaseException):
    """``error`` and every error it carries, each once: causes, contexts, and the per-rank failures a
    torch.distributed.checkpoint ``CheckpointException`` wraps as (exception, traceback) pairs."""
    stack, seen = [error], set()
    while stack:
        err = stack.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        stack += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            stack += [pair[0] if isinstance(pair, tuple) and pair else pair for pair in failures.values()]


def refusal_inside(error: BaseException) -> Optional["UnsafeCheckpoint"]:
    """The UnsafeCheckpoint that ``error`` carries (``errors_within``); None if there is none."""
    return next((err for err in errors_within(error) if isinstance(err, UnsafeCheckpoint)), None)
