"""Buffers on transparent huge pages (csrc/hugepages.h): the packed weights and the CPU KV
caches. They must behave exactly as torch.zeros / repack() would; where they sit is a speed
matter only, but what the code promises about it (2 MiB alignment, freeing) is checked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from backfill import kernels
from backfill.kernels import extension
from tests.kernels.test_qgemm import TYPES, random_raw

ext = extension()
pytestmark = pytest.mark.skipif(ext is None, reason="CPU kernels extension unavailable (no compiler, or disabled)")

HUGE = 2 << 20
# where huge pages are mapped at all (Linux, not turned off in this environment)
on_hugepages = pytest.mark.skipif(not sys.platform.startswith("linux") or os.environ.get("BACKFILL_HUGEPAGES") == "0",
                                  reason="huge pages: Linux only, and not BACKFILL_HUGEPAGES=0")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shape,dtype", [((3, 16, 3, 64), torch.float32), ((5,), torch.bfloat16),
                                         ((0, 16), torch.float32), ((1025, 7), torch.float16)])
def test_zeros_is_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = kernels.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    t.fill_(3)  # writable, every element
    assert bool((t == 3).all())


@on_hugepages
def test_zeros_hugepages_aligned_and_freed() -> None:
    assert ext.hugepages_enabled()
    big = ext.zeros_hugepages(3 * HUGE + 5)
    assert big.numel() == 3 * HUGE + 5 and big.data_ptr() % HUGE == 0
    assert int(big.sum()) == 0
    del big
    # each buffer is unmapped with its tensor: 40 x 64 MiB would otherwise hold 2.5 GiB
    before = rss_bytes()
    for _ in range(40):
        t = ext.zeros_hugepages(64 << 20)
        t[::4096] = 1
        del t
    assert rss_bytes() - before < 256 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages: Linux only")
def test_hugepages_off_by_env() -> None:
    code = ("from backfill.kernels import extension; e = extension(); t = e.zeros_hugepages(1 << 22); "
            "print(e.hugepages_enabled(), int(t.sum()), t.numel())")
    env = dict(os.environ, BACKFILL_HUGEPAGES="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "0", str(1 << 22)]


@pytest.mark.parametrize("name", list(TYPES))
def test_repack_into_out_is_repack(name: str) -> None:
    qtype, rows, cols = TYPES[name], 37, 512 if name in ("Q4_K", "Q6_K") else 416
    raw = random_raw(qtype, rows, cols)
    expected = ext.repack(raw, qtype, cols)
    assert ext.packed_bytes(qtype, rows, cols) == expected.numel()
    arena = ext.zeros_hugepages(expected.numel() + 128)
    got = ext.repack(raw, qtype, cols, out=arena[64:64 + expected.numel()])
    assert got.data_ptr() == arena.data_ptr() + 64 and torch.equal(got, expected)
    assert int(arena[:64].sum()) == 0 and int(arena[64 + expected.numel():].sum()) == 0
    with pytest.raises(RuntimeError, match="out must be"):
        ext.repack(raw, qtype, cols, out=arena[: expected.numel() - 1])


@on_hugepages
def test_engine_kv_caches_on_hugepages() -> None:
    """The ModelRunner's CPU KV caches come from zeros_hugepages (each a 2 MiB-aligned mapping),
    zeroed, and the engine generates through them."""
    from backfill.engine.llm import LLM
    from backfill.sampling_params import SamplingParams

    llm = LLM(max_num_seqs=2, num_kv_blocks=64, seed=0)
    caches = llm.engine.runner.kv_caches
    assert all(t.data_ptr() % HUGE == 0 and t.dtype == torch.float32 for pair in caches for t in pair)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert bool(caches[0][0].abs().sum() > 0)  # the prompt's K went into the first layer's cache
