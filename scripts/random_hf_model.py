"""Write a random-weight Llama in Hugging Face format (config.json, model.safetensors, the
default model's tokenizer files), for speed measurements of a model size no package carries.

The weights are random (std 0.02, norms 1): the text is noise, but a step costs what the same
architecture's real weights cost, which is all `backfill bench` measures. Usage:

    python scripts/random_hf_model.py OUT_DIR [--shape llama-1b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

# Llama-3.2-1B's and Llama-3.1-8B's shapes (vocabulary: the default model's tokenizer), and a
# tiny one for checking the script itself.
SHAPES = {
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=10000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-position-embeddings", type=int, default=8192)
    args = parser.parse_args()
    start = time.perf_counter()
    from safetensors.torch import save_file

    from backfill.tokenizer import load_tokenizer

    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer = load_tokenizer(None)
    tokenizer.hf.save_pretrained(args.out_dir)
    vocab_size = len(tokenizer.hf)
    shape = SHAPES[args.shape]
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.hf.bos_token_id, eos_token_id=tokenizer.hf.eos_token_id, torch_dtype="bfloat16",
        **shape,
    )
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    gen = torch.Generator(device=args.device).manual_seed(0)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=args.device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    state = {"model.embed_tokens.weight": matrix(vocab_size, hidden), "model.norm.weight": ones(hidden),
             "lm_head.weight": matrix(vocab_size, hidden)}
    for i in range(shape["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for name, (rows, cols) in {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
                                   "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
                                   "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                                   "mlp.down_proj": (hidden, inter)}.items():
            state[pre + name + ".weight"] = matrix(rows, cols)
        state[pre + "input_layernorm.weight"] = ones(hidden)
        state[pre + "post_attention_layernorm.weight"] = ones(hidden)
    save_file(state, os.path.join(args.out_dir, "model.safetensors"), metadata={"format": "pt"})
    num_params = sum(t.numel() for t in state.values())
    print(f"wrote {args.shape} ({num_params / 1e9:.2f} B parameters, random) to {args.out_dir} "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
