"""What an opt-in, inexact variant of the CPU kernels changes against the exact fp32 path (the
default, parity-tested against transformers' fp32 model): int8 activations
(`--activation-quantization int8`, csrc/q8.h) or a 16- or 8-bit KV cache (`--kv-cache-dtype
bfloat16|float16|fp8_e4m3|fp8_e5m2`):

    backfill bench divergence [--variant int8-activations|bf16-kv-cache|fp16-kv-cache|fp8-e4m3-kv-cache|
                               fp8-e5m2-kv-cache] [--num-prompts 32]
                              [--max-tokens 64] [--seed 0] [--model M]

- Greedy agreement: every prompt generated greedily by two engines, one per mode; the share of
  prompts whose outputs are token for token the same, and the mean share of the fp32 output
  that the variant's output repeats before it first differs.
- Logit error: each prompt followed by the fp32 output, run through one CpuDecoder in one step
  (teacher-forced) exactly and as the variant: the largest |logit difference| over every
  position of every prompt (beside the largest |logit|, for scale), the mean, and the share of
  positions whose argmax (the greedy choice) is the same.

The prompts are drawn from the benchmark corpus (workloads.make_prompt), seeded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from backfill.config import EngineConfig
from backfill.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# (torch and numpy imported where used: the CLI reads VARIANTS for its --variant choices)


# Each variant as the engine fields it sets (the exact path: activation_quantization "none",
# kv_cache_dtype "auto"), and its name in the report.
VARIANTS: dict[str, dict[str, str]] = {
    "int8-activations": {"activation_quantization": "int8"},
    "bf16-kv-cache": {"kv_cache_dtype": "bfloat16"},
    "fp16-kv-cache": {"kv_cache_dtype": "float16"},
    "fp8-e4m3-kv-cache": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8-e5m2-kv-cache": {"kv_cache_dtype": "fp8_e5m2"},
}
_TITLES = {"int8-activations": "int8 activations", "bf16-kv-cache": "a bf16 KV cache",
           "fp16-kv-cache": "an fp16 KV cache", "fp8-e4m3-kv-cache": "an fp8 (E4M3) KV cache",
           "fp8-e5m2-kv-cache": "an fp8 (E5M2) KV cache"}
_EXACT = {"activation_quantization": "none", "kv_cache_dtype": "auto"}


@dataclass
class Divergence:
    variant: str
    num_prompts: int
    max_tokens: int
    same_outputs: int  # prompts whose greedy outputs are identical
    mean_agreed_share: float  # mean over prompts of (tokens before the first difference) / fp32 output length
    positions: int  # teacher-forced positions compared
    max_abs_logit_error: float
    mean_abs_logit_error: float
    max_abs_logit: float  # the fp32 logits' largest magnitude, for scale
    argmax_agreement: float  # share of positions whose argmax is the same
    kernels: str


def make_prompts(num_prompts: int, min_words: int, max_words: int, seed: int) -> list[str]:
    import numpy as np

    from backfill.bench.workloads import make_prompt

    rng = np.random.default_rng(seed)
    return [make_prompt(int(rng.integers(min_words, max_words + 1)), rng) for _ in range(num_prompts)]


def greedy_outputs(config: EngineConfig, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt token ids, greedy output token ids) of each prompt, on an engine of `config`."""
    from backfill.engine.llm import LLM

    fields = {k: v for k, v in asdict(config).items() if k != "model"}
    llm = LLM(config.model, **fields)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.prompt_token_ids for o in outputs], [o.outputs[0].token_ids for o in outputs]


def _agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def teacher_forced_logits(decoder: Any, token_ids: list[int], block_size: int = 16,
                          kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits [T, V] of every position of `token_ids` run as one prompt through `decoder`, over
    KV caches of `kv_dtype` (None: fp32)."""
    import torch

    from backfill.model.attention import build_attention_metadata

    kv_dtype = torch.float32 if kv_dtype is None else kv_dtype

    num_tokens = len(token_ids)
    num_blocks = math.ceil(num_tokens / block_size)
    caches = decoder.make_kv_caches(num_blocks, block_size, kv_dtype)
    positions, meta = build_attention_metadata([0], [num_tokens], [list(range(num_blocks))], block_size,
                                               torch.device("cpu"))
    ids = torch.tensor(token_ids, dtype=torch.int64)
    return decoder.forward_logits(ids, positions, caches, meta, torch.arange(num_tokens))


def measure_divergence(config: EngineConfig, num_prompts: int, max_tokens: int, seed: int,
                       prompt_words: tuple[int, int] = (8, 160), variant: str = "int8-activations") -> Divergence:
    from dataclasses import replace

    import torch

    from backfill.model.cpu_decoder import load_cpu_decoder
    from backfill.model.loader import kv_cache_torch_dtype

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    exact_config = replace(config, **_EXACT)
    variant_config = replace(exact_config, **VARIANTS[variant])
    prompts = make_prompts(num_prompts, prompt_words[0], prompt_words[1], seed)
    prompt_ids, reference = greedy_outputs(exact_config, prompts, max_tokens)
    _, quantized = greedy_outputs(variant_config, prompts, max_tokens)
    same = sum(a == b for a, b in zip(reference, quantized))
    shares = [_agreed_prefix(a, b) / len(a) if a else float(a == b) for a, b in zip(reference, quantized)]

    decoder = load_cpu_decoder(config.model, config.quantization)
    max_err = total_err = max_logit = 0.0
    positions = agree = 0
    kv_dtype = kv_cache_torch_dtype(variant_config.kv_cache_dtype, torch.float32)
    for ids, out in zip(prompt_ids, reference):
        decoder.activation_quantization = "none"
        exact = teacher_forced_logits(decoder, ids + out)  # [T, V]
        decoder.activation_quantization = variant_config.activation_quantization
        approx = teacher_forced_logits(decoder, ids + out, kv_dtype=kv_dtype)
        err = (approx - exact).abs()
        max_err = max(max_err, float(err.max()))
        total_err += float(err.double().mean()) * len(exact)
        max_logit = max(max_logit, float(exact.abs().max()))
        positions += len(exact)
        agree += int((approx.argmax(dim=-1) == exact.argmax(dim=-1)).sum())
    kernels = decoder.kernels
    return Divergence(variant, num_prompts, max_tokens, same, sum(shares) / len(shares), positions, max_err,
                      total_err / positions, max_logit, agree / positions, kernels)


def format_divergence(d: Divergence) -> str:
    return "\n".join([
        f"{_TITLES[d.variant]} ({d.kernels}) against the exact fp32 path, {d.num_prompts} prompts, greedy, "
        f"up to {d.max_tokens} tokens each:",
        f"  greedy agreement: {d.same_outputs}/{d.num_prompts} outputs identical "
        f"({d.same_outputs / d.num_prompts:.0%}); on average {d.mean_agreed_share:.1%} of the fp32 output "
        "repeated before the first difference",
        f"  teacher-forced logits over {d.positions} positions: max |error| {d.max_abs_logit_error:.4f} "
        f"(largest |logit| {d.max_abs_logit:.2f}), mean |error| {d.mean_abs_logit_error:.5f}, "
        f"argmax agreement {d.argmax_agreement:.2%}",
    ])
