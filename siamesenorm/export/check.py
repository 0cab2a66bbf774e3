"""An exported folder from elsewhere, checked before anything in it is built or read (generate.py, evaluate.py).

``check_export(folder)`` raises UnsafeCheckpoint (one line, naming the file and what was refused) unless:

- ``config.json`` is a JSON object of at most ``MAX_JSON_BYTES`` whose model sizes are integers within
  ``FIELD_BOUNDS`` (a 1 KB config cannot ask for a model of terabytes);
- ``model.safetensors`` has a header of at most ``MAX_HEADER_BYTES`` that is a JSON object of tensors, each of a
  known dtype, a shape of non-negative integers, and data offsets inside the file that match its shape, with no two
  tensors overlapping;
- the model the config implies, built on the meta device (no memory), has exactly the tensors the file holds,
  names and shapes (so the model built for real is no larger than the weights file);
- ``tokenizer_config.json``, if present, is a JSON object that names no code (no ``auto_map``) and a tokenizer
  class transformers ships.

Only then does transformers load the folder.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Dict, Union

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from siamesenorm.export.remote.modeling_siamesenorm import HF_MODEL_TYPE
from siamesenorm.models.build import build_model
from siamesenorm.models.config import SiameseModelConfig
from siamesenorm.run.safeload import UnsafeCheckpoint

__all__ = ["check_export", "read_json_object", "read_safetensors_header", "MAX_JSON_BYTES", "MAX_HEADER_BYTES",
           "FIELD_BOUNDS"]

MAX_JSON_BYTES = 2**20
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
#: The model sizes a config may state (far above any model this project trains; below what would exhaust a node).
FIELD_BOUNDS = {"n_layers": 1024, "d_model": 65536, "n_heads": 1024, "n_kv_heads": 1024, "vocab_size": 2**22,
                "embedding_size": 2**22, "max_sequence_length": 2**22, "mlp_hidden_size": 2**20, "mlp_ratio": 64,
                "hc_expansion_rate": 16, "mhc_expansion_rate": 16, "mhc_sinkhorn_iterations": 1000,
                "num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 2**20,
                "num_attention_heads": 1024, "num_key_value_heads": 1024, "max_position_embeddings": 2**22,
                "head_dim": 65536}
_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend", "LlamaTokenizerFast", "LlamaTokenizer",
                      "GPT2TokenizerFast"}


def _refuse(file: Path, why: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing to load {file}: {why}; nothing in the folder was built or run.")


def read_json_object(file: Path, what: str = "a config") -> dict:
    """A JSON object of at most MAX_JSON_BYTES (NaN and Infinity refused), or UnsafeCheckpoint."""
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise _refuse(file, f"{size:,d} bytes, more than {what} holds")
    try:
        value = json.loads(file.read_bytes(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, RecursionError) as err:
        raise _refuse(file, f"not JSON ({type(err).__name__})") from None
    if not isinstance(value, dict):
        raise _refuse(file, f"a JSON {type(value).__name__}, not an object")
    return value


def _check_fields(file: Path, fields: dict) -> None:
    for name, bound in FIELD_BOUNDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= bound or (
                isinstance(value, float) and not value.is_integer() and name != "mlp_ratio"):
            raise _refuse(file, f"{name} = {str(value)[:40]}, not a number from 0 to {bound:,d}")


def read_safetensors_header(file: Path) -> Dict[str, tuple]:
    """{tensor name: (dtype, shape)} of a safetensors file, refused unless its header is bounded and every tensor's
    bytes lie inside the file, match its shape and overlap no other."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(file, "not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise _refuse(file, f"a safetensors header of {length:,d} bytes in a file of {size:,d}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise _refuse(file, "a safetensors header that is not JSON") from None
    if not isinstance(header, dict):
        raise _refuse(file, "a safetensors header that is not an object")
    data_bytes, spans, out = size - 8 - length, [], {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPES and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])):
            raise _refuse(file, f"tensor {name[:80]!r} has a malformed header entry")
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= data_bytes:
            raise _refuse(file, f"tensor {name[:80]!r} lies outside the file (bytes {start:,d}-{end:,d} of "
                                f"{data_bytes:,d})")
        if end - start != math.prod(entry["shape"]) * _DTYPES[entry["dtype"]]:
            raise _refuse(file, f"tensor {name[:80]!r} of shape {entry['shape']} has {end - start:,d} bytes")
        spans.append((start, end, name))
        out[name] = (entry["dtype"], tuple(entry["shape"]))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise _refuse(file, f"tensors {name[:60]!r} and {other[:60]!r} share bytes")
    return out


def _expected_tensors(config: dict) -> Dict[str, tuple]:
    """{name: shape} of the model ``config`` implies, built on the meta device."""
    if config.get("model_type") == HF_MODEL_TYPE:
        olmo = dict(config.get("olmo") or {})
        olmo["init_device"] = "meta"
        inner = build_model(SiameseModelConfig.new(**olmo), olmo.get("model_type") or "pre", init_params=False)
        return {f"model.{k}": tuple(v.shape) for k, v in inner.state_dict().items()}
    fields = {k: v for k, v in config.items() if k not in ("auto_map", "architectures", "transformers_version")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def check_export(folder: Union[str, Path]) -> None:
    """Raise UnsafeCheckpoint unless the exported ``folder`` passes every check in the module docstring."""
    folder = Path(folder)
    config_file, weights = folder / "config.json", folder / "model.safetensors"
    config = read_json_object(config_file)
    if config.get("model_type") not in (HF_MODEL_TYPE, "llama"):
        raise _refuse(config_file, f"model_type {str(config.get('model_type'))[:40]!r} (an export of this project "
                                   "is siamesenorm_olmo or llama)")
    fields = config.get("olmo") if config.get("model_type") == HF_MODEL_TYPE else config
    if not isinstance(fields, dict):
        raise _refuse(config_file, "its olmo fields are not an object")
    _check_fields(config_file, fields)
    if not weights.is_file():
        raise _refuse(weights, "the folder has no model.safetensors (sharded or .bin weights are not read here)")
    held = read_safetensors_header(weights)
    try:
        expected = _expected_tensors(config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise _refuse(config_file, f"a config that builds no model ({type(err).__name__}: {str(err)[:100]})") \
            from None
    if expected.keys() != held.keys():
        missing, extra = sorted(expected.keys() - held.keys()), sorted(held.keys() - expected.keys())
        raise _refuse(weights, f"its tensors are not the model's that config.json states (missing {missing[:3]}, "
                               f"unexpected {extra[:3]})")
    for name, shape in expected.items():
        if held[name][1] != shape:
            raise _refuse(weights, f"tensor {name} has shape {list(held[name][1])}; config.json's model needs "
                                   f"{list(shape)}")
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        tok = read_json_object(tokenizer_config, "a tokenizer config")
        if "auto_map" in tok or tok.get("tokenizer_class", "PreTrainedTokenizerFast") not in _TOKENIZER_CLASSES:
            raise _refuse(tokenizer_config, "a tokenizer that needs code of its own (auto_map or tokenizer_class "
                                            f"{str(tok.get('tokenizer_class'))[:40]!r}); this project's exports use "
                                            "a plain tokenizer.json")
