"""A GGUF file's weights as stored (raw ggml blocks, no dequantization) in CpuDecoder's
state-dict layout: our parameter names, q/k/v and gate/up as row segments of one linear.

The counterpart of loader._read_gguf (which expands everything to fp32): same config, same
names, same row order (a llama GGUF's q/k rows unpermuted back to the rotate-half layout; a
row permutation works on whole rows of blocks as well as on floats).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from backfill.model.config import ModelConfig
from backfill.model.cpu_decoder import SUPPORTED_QTYPES, LinearWeights, PackedWeight
from backfill.model.loader import _GGUF_LAYER_NAMES, _copy_unpermuted, _GGUFFile, _GGUFTensorInfo


def read_gguf_packed(path: str) -> tuple[ModelConfig, dict[str, LinearWeights]]:
    """Config and CpuDecoder state from a GGUF file. Norms and biases come back as fp32 tensors,
    every matrix as a PackedWeight (a view of the file's map, or an unpermuted copy); fused
    linears as lists of segments: qkv_proj [q, k, v], gate_up_proj [gate, up].
    Raises ValueError for a tensor type the packed kernels do not read."""
    from gguf.quants import GGMLQuantizationType, dequantize

    gguf_file = _GGUFFile(path)
    infos = {info.name: info for info in gguf_file.tensors}

    def vector(name: str) -> Tensor:  # norms, biases, rope factors: fp32 [n]
        info = infos.pop(name)
        array = dequantize(gguf_file.tensor_data(info), GGMLQuantizationType(info.ggml_type))
        return torch.from_numpy(np.array(array, dtype=np.float32))  # copy: the map is read-only

    def matrix(name: str, unpermute_heads: int = 0) -> PackedWeight:
        info: _GGUFTensorInfo = infos.pop(name)
        if info.ggml_type not in SUPPORTED_QTYPES:
            raise ValueError(f"{path}: {name} has ggml type {info.ggml_type}, not read by the packed kernels")
        cols, rows = info.dims[0], int(np.prod(info.dims[1:]))
        raw = np.asarray(gguf_file.tensor_data(info)).view(np.uint8).reshape(rows, -1)  # [rows, row_bytes]
        with warnings.catch_warnings():  # a read-only view of the map: never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(raw)
        if unpermute_heads:
            unpermuted = torch.empty_like(data)  # [rows, row_bytes]
            _copy_unpermuted(unpermuted, data, unpermute_heads)
            data = unpermuted
        return PackedWeight(data, info.ggml_type, rows, cols)

    meta = gguf_file.metadata
    arch = meta["general.architecture"]
    meta.setdefault(f"{arch}.vocab_size", infos["token_embd.weight"].dims[-1])
    freq_factors = vector("rope_freqs.weight").tolist() if "rope_freqs.weight" in infos else None
    config = ModelConfig.from_gguf_metadata(meta, set(infos), freq_factors)
    permuted = arch in ("llama", "mistral")  # see loader._read_gguf
    state: dict[str, LinearWeights] = {"norm.weight": vector("output_norm.weight")}
    state["embed_tokens.weight"] = matrix("token_embd.weight")
    if "output.weight" in infos:
        state["lm_head.weight"] = matrix("output.weight")
    for i in range(config.num_layers):
        blk, pre = f"blk.{i}.", f"layers.{i}."
        for gguf_name, ours in _GGUF_LAYER_NAMES.items():
            state[pre + ours] = vector(blk + gguf_name) if ours.endswith("norm.weight") else matrix(blk + gguf_name)
        state[pre + "self_attn.qkv_proj.weight"] = [
            matrix(blk + "attn_q.weight", config.num_heads if permuted else 0),
            matrix(blk + "attn_k.weight", config.num_kv_heads if permuted else 0),
            matrix(blk + "attn_v.weight"),
        ]
        if config.attention_bias:
            q, k = vector(blk + "attn_q.bias"), vector(blk + "attn_k.bias")
            if permuted:
                q, k = _unpermuted(q, config.num_heads), _unpermuted(k, config.num_kv_heads)
            state[pre + "self_attn.qkv_proj.bias"] = torch.cat([q, k, vector(blk + "attn_v.bias")])
        state[pre + "mlp.gate_up_proj.weight"] = [matrix(blk + "ffn_gate.weight"), matrix(blk + "ffn_up.weight")]
    if infos:
        raise ValueError(f"{path}: unexpected tensors {sorted(infos)[:8]}")
    return config, state


def _unpermuted(v: Tensor, num_heads: int) -> Tensor:
    out = torch.empty_like(v)  # [heads * head_dim]
    _copy_unpermuted(out, v, num_heads)
    return out
