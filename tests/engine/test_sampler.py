"""Sampler: greedy and random sampling, truncation, penalties, seeds and logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from backfill.sampling_params import SamplingParams
from backfill.worker.sampler import Sampler

EOS = 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def make_sampler(device: torch.device, vocab_size: int = 64, seed: int = 0) -> Sampler:
    return Sampler(vocab_size=vocab_size, eos_token_ids=(EOS,), device=device, seed=seed)


def random_logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, vocab_size), generator=generator) * scale  # [S, V]


def run_steps(sampler: Sampler, request_ids: list[str], logits_per_step: Iterator[torch.Tensor]) -> list[list[int]]:
    """Sample once per logits tensor; returns the tokens per request id, in request_ids order."""
    tokens: list[list[int]] = [[] for _ in request_ids]
    for logits in logits_per_step:
        out = sampler.sample(request_ids, logits.to(sampler.device))
        for column, token_id in zip(tokens, out.token_ids):
            column.append(token_id)
    return tokens


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_leaves_logits_unchanged(device: torch.device) -> None:
    sampler = make_sampler(device, vocab_size=1000)
    ids = [f"r{i}" for i in range(16)]
    for request_id in ids:
        sampler.add_request(request_id, SamplingParams(temperature=0.0), [5, 6])
    logits = random_logits(16, 1000, seed=1).to(device)  # [S, V]
    before = logits.clone()
    out = sampler.sample(ids, logits)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy(device: torch.device) -> None:
    """The fast random path with top_k=1 against plain greedy, with penalties and bias in play."""
    vocab = 300
    extras: list[dict[str, object]] = [
        {},
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"logit_bias": {7: 5.0, 8: -3.0}},
        {"min_p": 0.3, "top_p": 0.9},
    ]
    ids = [f"r{i}" for i in range(len(extras))]
    greedy, top1 = make_sampler(device, vocab), make_sampler(device, vocab, seed=7)
    for request_id, extra in zip(ids, extras):
        greedy.add_request(request_id, SamplingParams(temperature=0.0, **extra), [1, 2, 3])  # type: ignore[arg-type]
        top1.add_request(request_id, SamplingParams(temperature=1.3, top_k=1, **extra), [1, 2, 3])  # type: ignore[arg-type]
    steps = [random_logits(len(ids), vocab, seed=100 + s) for s in range(8)]
    assert run_steps(top1, ids, iter(steps)) == run_steps(greedy, ids, iter(steps))


def test_greedy_rows_in_a_mixed_batch_are_argmax(device: torch.device) -> None:
    sampler = make_sampler(device, vocab_size=500)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, top_p=0.5, seed=3), SamplingParams(temperature=1e-7)]  # fmt: skip
    ids = [f"r{i}" for i in range(len(params))]
    for request_id, p in zip(ids, params):
        sampler.add_request(request_id, p, [1])
    logits = random_logits(len(ids), 500, seed=2).to(device)
    expected = logits.argmax(dim=-1).tolist()
    out = sampler.sample(ids, logits)
    for row in (0, 2, 4):  # a temperature below 1e-5 is greedy too
        assert out.token_ids[row] == expected[row]


# -- seeds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=1234),
        SamplingParams(temperature=1.2, top_p=0.95, frequency_penalty=0.4, seed=-5),
        SamplingParams(temperature=0.8, top_k=10, min_p=0.05, seed=2**64 - 1),
    ],
)
def test_seeded_request_is_independent_of_the_batch(device: torch.device, params: SamplingParams) -> None:
    vocab, num_steps = 64, 12
    target_logits = random_logits(num_steps, vocab, seed=11, scale=1.5)  # [steps, V]: one row per step

    alone = make_sampler(device, vocab, seed=0)
    alone.add_request("target", params, [3, 4, 5])
    solo = run_steps(alone, ["target"], (target_logits[s : s + 1] for s in range(num_steps)))[0]

    # Same request among changing companions, at a different row each step, different global seed.
    batch = make_sampler(device, vocab, seed=99)
    companions = {
        "random": SamplingParams(temperature=1.0),
        "greedy": SamplingParams(temperature=0.0, repetition_penalty=1.3),
        "same-seed": SamplingParams(temperature=0.9, seed=1234),
        "truncated": SamplingParams(temperature=0.7, top_k=3, top_p=0.6, min_p=0.1),
        "biased": SamplingParams(temperature=1.0, logit_bias={1: 3.0}, min_tokens=4),
    }
    batch.add_request("target", params, [3, 4, 5])
    for request_id, p in companions.items():
        batch.add_request(request_id, p, [9])
    names = list(companions)
    in_batch = []
    for step in range(num_steps):
        others = names[: 1 + step % len(names)] if step % 3 else names[step % len(names) :]
        position = step % (len(others) + 1)
        request_ids = others[:position] + ["target"] + others[position:]
        logits = random_logits(len(request_ids), vocab, seed=500 + step, scale=1.5)
        logits[position] = target_logits[step]
        out = batch.sample(request_ids, logits.to(device))
        in_batch.append(out.token_ids[position])
    assert in_batch == solo
    assert len(set(solo)) > 1  # it really sampled


def test_unseeded_sampling_follows_the_sampler_seed(device: torch.device) -> None:
    logits = random_logits(32, 64, seed=4, scale=0.5)
    runs = []
    for seed in (5, 5, 6):
        sampler = make_sampler(device, 64, seed=seed)
        ids = [f"r{i}" for i in range(32)]
        for request_id in ids:
            sampler.add_request(request_id, SamplingParams(temperature=1.0), [1])
        runs.append(run_steps(sampler, ids, iter([logits] * 3)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# -- distributions --------------------------------------------------------------------------------

DIST_LOGITS = [2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -1.0, -2.0]
NUM_DRAWS = 20_000
# NOTE: under a correct sampler Pearson's statistic follows chi-square(K - 1), so a p-value below
# 1e-6 happens once in a million seeds; draws are seeded, so the test is deterministic. A token
# kept or dropped wrongly fails the exact zero-mass check; a wrong temperature, or a truncated set
# not renormalized, moves the statistic by hundreds (e.g. T=0.7 vs T=1 on token 0: 0.47 vs 0.37).
MIN_P_VALUE = 1e-6


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """Naive reference: softmax(logits / T), then top-k, top-p (on the renormalized top-k), min-p."""
    scaled = [x / params.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = order[: params.top_k] if params.top_k > 0 else order
    if params.top_p < 1.0:
        mass = sum(probs[i] for i in keep)
        kept, cumulative = [], 0.0
        for i in keep:
            if cumulative >= params.top_p:
                break
            kept.append(i)
            cumulative += probs[i] / mass
        keep = kept
    if params.min_p > 0.0:
        threshold = params.min_p * max(probs[i] for i in keep)
        keep = [i for i in keep if probs[i] >= threshold]
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def chi_square_p_value(counts: list[int], expected_probs: list[float]) -> float:
    cells = [(c, p * sum(counts)) for c, p in zip(counts, expected_probs) if p > 0]
    statistic = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


DIST_CASES = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "top_k3": SamplingParams(temperature=1.0, top_k=3),
    "top_p0.7": SamplingParams(temperature=1.0, top_p=0.7),  # keeps 3: cumulative 0.62, 0.77
    "top_p0.9_t0.7": SamplingParams(temperature=0.7, top_p=0.9),  # keeps 4
    "min_p0.15": SamplingParams(temperature=1.0, min_p=0.15),  # keeps 5
    "top_k5_top_p0.8": SamplingParams(temperature=1.0, top_k=5, top_p=0.8),  # top_p over the top 5: keeps 3
    "top_k6_min_p0.2": SamplingParams(temperature=1.0, top_k=6, min_p=0.2),  # keeps 4
}


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-generator", "own-generators"])
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_empirical_frequencies_match_the_distribution(device: torch.device, name: str, seeded: bool) -> None:
    params = DIST_CASES[name]
    vocab = len(DIST_LOGITS)
    sampler = make_sampler(device, vocab, seed=2024)
    # One batch of NUM_DRAWS requests with identical rows: batched sampling, one draw each.
    ids = [f"r{i}" for i in range(NUM_DRAWS)]
    for i, request_id in enumerate(ids):
        p = params
        if seeded:
            p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                               min_p=params.min_p, seed=10_000 + i)  # fmt: skip
        sampler.add_request(request_id, p, [0])
    logits = torch.tensor([DIST_LOGITS]).expand(NUM_DRAWS, vocab).contiguous()  # [S, V]
    tokens = sampler.sample(ids, logits.to(device)).token_ids
    counts = [tokens.count(t) for t in range(vocab)]
    expected = reference_probs(DIST_LOGITS, params)
    assert [c for c, p in zip(counts, expected) if p == 0.0] == [0] * expected.count(0.0)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, (counts, [round(p * NUM_DRAWS) for p in expected], p_value)


def test_chi_square_check_rejects_a_wrong_distribution() -> None:
    """The statistical check itself has power: T=1 frequencies against the T=0.7 distribution."""
    probs = reference_probs(DIST_LOGITS, SamplingParams(temperature=1.0))
    counts = [round(p * NUM_DRAWS) for p in probs]
    assert chi_square_p_value(counts, probs) > 0.5
    assert chi_square_p_value(counts, reference_probs(DIST_LOGITS, SamplingParams(temperature=0.7))) < 1e-30


# -- penalties, bias, min_tokens ------------------------------------------------------------------


def reference_process(
    row: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int], eos_ids: tuple[int, ...]
) -> torch.Tensor:
    """Naive per-token reference: penalties, then logit_bias, then the min_tokens mask."""
    row = row.clone()  # [V]
    for token_id in range(row.shape[0]):
        count = outputs.count(token_id)
        value = row[token_id]
        if token_id in prompt or count:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        value = value - params.frequency_penalty * count
        value = value - params.presence_penalty * (count > 0)
        row[token_id] = value
    for token_id, bias in (params.logit_bias or {}).items():
        row[token_id] += bias
    if len(outputs) < params.min_tokens:
        for token_id in (params.stop_token_ids or []) + ([] if params.ignore_eos else list(eos_ids)):
            row[token_id] = float("-inf")
    return row


def test_penalties_bias_and_min_tokens_match_the_reference(device: torch.device) -> None:
    """Greedy requests with random penalty settings, over many steps, against the naive reference."""
    vocab, num_requests, num_steps = 40, 12, 10
    generator = torch.Generator().manual_seed(3)

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    requests = []
    for i in range(num_requests):
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=uniform(0.5, 2.0) if i % 3 else 1.0,
            frequency_penalty=uniform(-1.0, 2.0) if i % 2 else 0.0,
            presence_penalty=uniform(-1.0, 2.0) if i % 4 else 0.0,
            logit_bias={int(t): uniform(-5, 5) for t in torch.randint(0, vocab, (i % 3,), generator=generator)},
            min_tokens=i % 5,
            stop_token_ids=[5, 6] if i % 2 else None,
            ignore_eos=i % 4 == 1,
        )
        prompt = torch.randint(0, vocab, (1 + i,), generator=generator).tolist()
        requests.append((f"r{i}", params, prompt, []))
    sampler = make_sampler(device, vocab)
    for request_id, params, prompt, _ in requests:
        sampler.add_request(request_id, params, prompt)
    ids = [r[0] for r in requests]
    for step in range(num_steps):
        # Low-variance logits around EOS so that penalties and masks decide the winners.
        logits = random_logits(num_requests, vocab, seed=step, scale=0.7)
        logits[:, EOS] += 1.0
        out = sampler.sample(ids, logits.to(device))
        for row, (_, params, prompt, outputs) in enumerate(requests):
            expected = reference_process(logits[row], params, prompt, outputs, (EOS,))
            assert out.token_ids[row] == int(expected.argmax()), (step, row)
            outputs.append(out.token_ids[row])
    assert any(len(set(outputs)) > 1 for *_, outputs in requests)


def test_each_penalty_moves_the_argmax(device: torch.device) -> None:
    logits = torch.full((1, 16), -1.0)
    logits[0, 3], logits[0, 4] = 2.0, 1.5  # token 3 wins unpenalized
    cases = [
        (SamplingParams(temperature=0.0), [0], [3, 3, 3]),
        (SamplingParams(temperature=0.0, repetition_penalty=2.0), [3], [4, 3, 3]),  # 3 in prompt: 1.0; then 4: 0.75
        (SamplingParams(temperature=0.0, presence_penalty=0.6), [0], [3, 4, 3]),  # 1.4 vs 1.5, then 1.4 vs 0.9
        (SamplingParams(temperature=0.0, frequency_penalty=0.3), [0], [3, 3, 4]),  # 3: 1.7, then 1.4
        (SamplingParams(temperature=0.0, logit_bias={9: 3.5}), [0], [9, 9, 9]),
        (SamplingParams(temperature=0.0, logit_bias={3: -1.0}), [0], [4, 4, 4]),
    ]
    for params, prompt, expected in cases:
        sampler = make_sampler(device, 16)
        sampler.add_request("r", params, prompt)
        assert run_steps(sampler, ["r"], iter([logits] * 3)) == [expected], params


def test_repetition_penalty_multiplies_negative_logits(device: torch.device) -> None:
    logits = torch.tensor([[-0.5, -0.8, -3.0, -3.0]])
    sampler = make_sampler(device, 4)
    sampler.add_request("r", SamplingParams(temperature=0.0, repetition_penalty=2.0), [0])
    assert sampler.sample(["r"], logits.to(device)).token_ids == [1]  # token 0: -0.5 * 2 = -1.0 < -0.8


def test_min_tokens_masks_eos_and_stop_token_ids(device: torch.device) -> None:
    logits = torch.zeros((1, 16))
    logits[0, EOS], logits[0, 7], logits[0, 8] = 5.0, 4.0, 3.0
    cases = [
        (SamplingParams(temperature=0.0, min_tokens=3), [7, 7, 7, EOS, EOS]),
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), [8, 8, 8, EOS, EOS]),
        (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True), [EOS, EOS, EOS]),
        (SamplingParams(temperature=0.0, stop_token_ids=[EOS]), [EOS, EOS]),  # min_tokens=0 masks nothing
    ]
    for params, expected in cases:
        sampler = make_sampler(device, 16)
        sampler.add_request("r", params, [1])
        assert run_steps(sampler, ["r"], iter([logits] * len(expected))) == [expected], params


def test_min_tokens_counts_each_request_separately(device: torch.device) -> None:
    logits = torch.zeros((2, 8))
    logits[:, EOS] = 5.0
    sampler = make_sampler(device, 8)
    sampler.add_request("early", SamplingParams(temperature=0.0, min_tokens=1), [1])
    sampler.add_request("late", SamplingParams(temperature=0.0, min_tokens=3), [1])
    tokens = run_steps(sampler, ["early", "late"], iter([logits] * 4))
    assert [t == EOS for t in tokens[0]] == [False, True, True, True]
    assert [t == EOS for t in tokens[1]] == [False, False, False, True]


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax(device: torch.device) -> None:
    vocab = 100
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logit_bias={4: 9.0}, logprobs=20),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    ids = [f"r{i}" for i in range(len(params))]
    sampler = make_sampler(device, vocab)
    for request_id, p in zip(ids, params):
        sampler.add_request(request_id, p, [4, 5])
    logits = random_logits(len(ids), vocab, seed=8)
    out = sampler.sample(ids, logits.to(device))
    assert out.logprobs is not None and len(out.logprobs) == len(ids)
    reference = logits.double().log_softmax(dim=-1)  # [S, V]: before penalties, bias and temperature
    assert out.logprobs[2] is None
    for row in (0, 1, 3):
        entry = out.logprobs[row]
        assert entry is not None
        n = params[row].logprobs
        assert entry.token_id == out.token_ids[row]
        assert entry.logprob == pytest.approx(float(reference[row, entry.token_id]), abs=1e-5)
        top = reference[row].topk(n) if n else None
        assert len(entry.top) == n
        if top is not None:
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.token_ids[1] == 4  # the bias decided the token; logprobs still show the raw model
    assert out.logprobs[1] is not None and out.logprobs[1].logprob < out.logprobs[1].top[0][1]


def test_no_logprobs_requested_gives_none(device: torch.device) -> None:
    sampler = make_sampler(device, 10)
    sampler.add_request("a", SamplingParams(temperature=1.0), [1])
    assert sampler.sample(["a"], torch.zeros((1, 10), device=device)).logprobs is None


# -- bookkeeping ----------------------------------------------------------------------------------


def test_penalty_slots_grow_and_are_reset_on_reuse(device: torch.device) -> None:
    vocab = 8
    logits = torch.zeros((1, vocab))
    logits[0, 3] = 1.0
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = make_sampler(device, vocab)
    ids = [f"r{i}" for i in range(20)]  # more than the initial table
    for request_id in ids:
        sampler.add_request(request_id, params, [0])
    tokens = run_steps(sampler, ids, iter([logits.expand(20, vocab)] * 2))
    assert all(t == [3, 0] for t in tokens)  # after one 3 (1.0 - 2.0), token 0 wins the tie at 0.0
    for request_id in ids:
        sampler.remove_request(request_id)
    assert sampler.num_requests == 0
    sampler.add_request("fresh", params, [0])  # reuses a slot that counted a 3
    assert sampler.sample(["fresh"], logits.to(device)).token_ids == [3]


def test_add_is_idempotent_and_remove_ignores_unknown_ids(device: torch.device) -> None:
    logits = torch.zeros((1, 8))
    logits[0, 3] = 1.0
    sampler = make_sampler(device, 8)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    sampler.add_request("r", params, [0])
    assert sampler.sample(["r"], logits.to(device)).token_ids == [3]
    sampler.add_request("r", params, [0])  # re-sent after preemption: history kept
    assert sampler.sample(["r"], logits.to(device)).token_ids == [0]
    sampler.remove_request("never-added")
    sampler.remove_request("r")
    sampler.remove_request("r")
    with pytest.raises(KeyError, match="never was added|never added|was never added"):
        sampler.sample(["r"], logits.to(device))


def test_logit_bias_outside_the_vocabulary_is_rejected(device: torch.device) -> None:
    sampler = make_sampler(device, 8)
    with pytest.raises(ValueError, match="^logit_bias"):
        sampler.add_request("r", SamplingParams(logit_bias={8: 1.0}), [0])
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        sampler.add_request("r", SamplingParams(allowed_token_ids=[1, 8]), [0])
    assert sampler.num_requests == 0


def test_allowed_token_ids_limit_their_rows_only(device: torch.device) -> None:
    """Greedy and random rows pick only allowed ids (the best of them when greedy), beside a row
    without the limit; raw logprobs stay those of the model's logits."""
    sampler = make_sampler(device, 64)
    allowed = [3, 17, 40]
    sampler.add_request("greedy", SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=1), [0])
    sampler.add_request("random", SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=3), [0])
    sampler.add_request("free", SamplingParams(temperature=0.0), [0])
    seen = set()
    for step in range(40):
        logits = random_logits(3, 64, seed=step).to(device)
        out = sampler.sample(["greedy", "random", "free"], logits)
        best_allowed = allowed[int(logits[0, allowed].argmax())]
        assert out.token_ids[0] == best_allowed and out.token_ids[1] in allowed
        assert out.token_ids[2] == int(logits[2].argmax())
        assert out.logprobs is not None and out.logprobs[0] is not None
        assert out.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[best_allowed]))
        seen.add(out.token_ids[1])
    assert seen == set(allowed)  # each allowed id is drawn (temperature 1.5, 40 draws)


def test_batch_composition_changes_between_calls(device: torch.device) -> None:
    """The cached per-batch plan must follow adds, removes and reordering."""
    vocab = 6
    sampler = make_sampler(device, vocab)
    sampler.add_request("a", SamplingParams(temperature=0.0), [0])
    sampler.add_request("b", SamplingParams(temperature=0.0, logit_bias={5: 10.0}), [0])
    logits = torch.zeros((2, vocab))
    logits[:, 1] = 1.0
    assert sampler.sample(["a", "b"], logits.to(device)).token_ids == [1, 5]
    assert sampler.sample(["b", "a"], logits.to(device)).token_ids == [5, 1]
    sampler.remove_request("b")
    sampler.add_request("b", SamplingParams(temperature=0.0), [0])
    assert sampler.sample(["a", "b"], logits.to(device)).token_ids == [1, 1]
    assert sampler.sample([], torch.zeros((0, vocab), device=device)).token_ids == []


def test_kernels_pick_the_same_tokens_as_torch() -> None:
    """With the CPU kernels (argmax_rows, inverse_cdf_sample) and without: the same tokens, step
    after step, for greedy, plain-temperature, truncated and seeded rows in one batch."""
    vocab = 5000
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.9), SamplingParams(temperature=0.7, min_p=0.05),
              SamplingParams(temperature=1.0, seed=7)]
    samplers = [make_sampler(torch.device("cpu"), vocab_size=vocab, seed=3) for _ in range(2)]
    if samplers[0]._argmax_rows is None:
        pytest.skip("CPU kernels extension unavailable")
    samplers[1]._argmax_rows = samplers[1]._inverse_cdf_sample = None  # the torch references
    ids = [f"r{i}" for i in range(len(params))]
    for sampler in samplers:
        for request_id, p in zip(ids, params):
            sampler.add_request(request_id, p, [5, 6])
    steps = [random_logits(len(ids), vocab, seed=step) for step in range(20)]
    assert run_steps(samplers[0], ids, iter(steps)) == run_steps(samplers[1], ids, iter(steps))


def test_top_p_candidate_path_matches_full_sort() -> None:
    """The top-p fast path (nucleus searched among the best candidates) equals the full sort,
    including rows that must fall back: flat distributions, top-k sets wider than the candidates."""
    from backfill.worker.sampler import _TOP_P_CANDIDATES, _apply_top_k_top_p, _apply_top_k_top_p_sorted

    gen = torch.Generator().manual_seed(0)
    vocab = 4 * _TOP_P_CANDIDATES
    scales = torch.tensor([8.0, 3.0, 0.01, 1.0, 5.0, 0.0])[:, None]  # 0.01 / 0.0: nearly / fully flat
    logits = torch.randn(6, vocab, generator=gen) * scales  # [6, V]
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 0.3, 0.7])[:, None]
    top_k = torch.tensor([vocab, 40, vocab, 2 * _TOP_P_CANDIDATES, 1, vocab])
    for k in (None, top_k):
        fast = _apply_top_k_top_p(logits, k, top_p)
        slow = _apply_top_k_top_p_sorted(logits, k, top_p)
        assert torch.equal(torch.isinf(fast), torch.isinf(slow))
        assert torch.equal(fast[~torch.isinf(fast)], slow[~torch.isinf(slow)])


def _bitmask(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    words = torch.zeros((len(allowed), (vocab_size + 31) // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31: the sign bit


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, repetition_penalty=2.0, logit_bias={7: 100.0}),
], ids=["greedy", "random", "top_k", "truncated_penalized_biased"])
def test_grammar_bitmask_limits_constrained_rows_only(device: torch.device, params: SamplingParams) -> None:
    from backfill.structured_output.manager import GrammarBitmask

    vocab = 70  # three mask words, the last one partly used
    sampler = make_sampler(device, vocab_size=vocab)
    for request_id in ("a", "b", "c"):
        sampler.add_request(request_id, params, [1, 2, 3])
    allowed = {"a": {5, 31, 63, 69}, "c": {32}}  # 31 and 63: sign bits of their words
    mask = GrammarBitmask(["c", "a"], _bitmask([allowed["c"], allowed["a"]], vocab))
    free = []
    for seed in range(30):
        logits = random_logits(3, vocab, seed).to(device)
        out = sampler.sample(["a", "b", "c"], logits, mask)
        assert out.token_ids[0] in allowed["a"] and out.token_ids[2] == 32
        free.append(out.token_ids[1])
    assert any(token not in allowed["a"] | allowed["c"] for token in free)  # row b is unconstrained


def test_bad_words_mask_a_words_last_token_after_the_rest(device: torch.device) -> None:
    """Word [5] is never picked; word [7, 9] only after 7; word [3, 4, 6] only after 3, 4."""
    logits = torch.zeros((1, 16))
    logits[0, 5], logits[0, 9], logits[0, 6], logits[0, 8] = 9.0, 8.0, 7.0, 1.0
    sampler = make_sampler(device, 16)
    params = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[5], [7, 9], [3, 4, 6]])
    sampler.add_request("r", params, [0])
    picked = []
    for forced in (7, None, 3, 4, None, 4, None):
        step = logits.clone()
        if forced is not None:  # steer the output onto a word's first tokens
            step[0, forced] = 20.0
        picked.append(sampler.sample(["r"], step.to(device)).token_ids[0])
    # 5 never; 9 not right after 7 (6 instead); 6 not right after 3, 4 (9 instead)
    assert picked == [7, 6, 3, 4, 9, 4, 9]
