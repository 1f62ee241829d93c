"""The transformers generate() baseline on a tiny random-weight Llama (no download)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backfill.bench.hf_baseline import generate_batch, run_hf_static  # noqa: E402
from backfill.bench.offline import step_summary  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama() -> object:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_generate_batch_forces_lengths_and_times_every_step(tiny_llama: object) -> None:
    new_tokens, times = generate_batch(tiny_llama, [[5, 6, 7], [8, 9]], max_new_tokens=6, pad_id=0)
    assert tuple(new_tokens.shape) == (2, 6)
    assert len(times) == 6 and times == sorted(times)


def test_left_padding_does_not_change_a_row(tiny_llama: object) -> None:
    alone, _ = generate_batch(tiny_llama, [[8, 9]], max_new_tokens=5, pad_id=0)
    padded, _ = generate_batch(tiny_llama, [[5, 6, 7, 10, 11], [8, 9]], max_new_tokens=5, pad_id=0)
    assert alone[0].tolist() == padded[1].tolist()


def test_static_batches_results_and_slot_states(tiny_llama: object) -> None:
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(5)]
    max_tokens = [2, 9, 3, 4, 1]
    run = run_hf_static(tiny_llama, prompts, max_tokens, batch_size=2, pad_id=0)
    assert [r.output_len for r in run.results] == max_tokens
    assert all(r.success for r in run.results)
    # batches (0, 1): 9 steps, (2, 3): 4 steps, (4,): 1 step with one empty slot
    assert len(run.step_stats) == 9 + 4 + 1
    first = run.step_stats[0]
    assert first.slot_states == ["useful", "useful"] and first.num_prefill_tokens == 6
    assert run.step_stats[2].slot_states == ["idle", "useful"]  # request 0 wanted only 2
    assert run.step_stats[-1].slot_states == ["useful", "empty"]
    useful = sum(max_tokens)
    shares = step_summary(run.step_stats)
    assert shares["useful_slot_share"] == pytest.approx(useful / (2 * 14))
    # everyone in a batch gets its answer when generate() returns
    r0, r1 = run.results[0], run.results[1]
    assert r0.latency == pytest.approx(r1.latency)
    assert r0.ttft <= r0.latency and len(r0.itl) == 1 and len(r1.itl) == 8
