"""Which grammar engine: llguidance vs xgrammar on the default model's tokenizer.

    python -m backfill.bench.grammar_engines [--batch 32] [--repeats 5]

Per engine: the tokenizer set-up, the compile time of a few JSON schemas (no cache), and the
time to fill one step's token mask for a batch of matchers (serial, one thread: what the
engine core does) while they follow a valid JSON text token by token. xgrammar is not a
dependency (on Linux it pulls triton, ~290 MB): install it beside the project to compare, e.g.
`pip install --target /tmp/xg --no-deps xgrammar apache-tvm-ffi` and `PYTHONPATH=/tmp/xg`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from backfill.tokenizer import load_tokenizer

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "temps": {"type": "array", "items": {"type": "number"}},
                                      "ok": {"type": "boolean"}}, "required": ["city", "temps", "ok"]},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["person"]},
]
TEXTS = ['{"name": "Alice Smith", "age": 31}', '{"city": "Paris", "temps": [1.5, 2, 3.25], "ok": true}',
         '{"person": {"first": "Bob", "last": "Lee"}, "tags": ["a", "c"], "score": 7.5}']


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def bench_llguidance(tokenizer: Any, vocab: int, batch: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=list(tokenizer.eos_token_ids))
    setup = time.perf_counter() - start
    compiles = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        compiles.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
    templates = [llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)))
                 for s in SCHEMAS]
    matchers = [templates[i % len(SCHEMAS)].deep_copy() for i in range(batch)]
    mask = llguidance.torch.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, mask, row)

    def accept(row: int, token: int) -> None:
        assert matchers[row].consume_token(token), matchers[row].get_error()

    return {"setup": setup, "compiles": compiles, "fill": _follow(tokenizer, batch, fill, accept)}


def bench_xgrammar(tokenizer: Any, vocab: int, batch: int) -> dict[str, Any]:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    compiles = []
    compiled = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema)))
        compiles.append(time.perf_counter() - start)
    matchers = [xgrammar.GrammarMatcher(compiled[i % len(SCHEMAS)]) for i in range(batch)]
    mask = xgrammar.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, row)

    def accept(row: int, token: int) -> None:
        assert matchers[row].accept_token(token)

    return {"setup": setup, "compiles": compiles, "fill": _follow(tokenizer, batch, fill, accept)}


def _follow(tokenizer: Any, batch: int, fill: Any, accept: Any) -> float:
    """Median time of one step's mask for the batch, the matchers following TEXTS."""
    tokens = [tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False) for i in range(batch)]
    times = []
    for step in range(min(len(t) for t in tokens)):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        for row in range(batch):
            accept(row, tokens[row][step])
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None)
    vocab = tokenizer.vocab_size
    engines = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}
    for name, bench in engines.items():
        try:
            runs = [bench(tokenizer, vocab, args.batch) for _ in range(args.repeats)]
        except ImportError as error:
            print(f"{name}: not installed ({error})")
            continue
        compiles = [statistics.median(run["compiles"][i] for run in runs) for i in range(len(SCHEMAS))]
        fill = statistics.median(run["fill"] for run in runs)
        print(f"{name}: tokenizer set-up {_ms(statistics.median(r['setup'] for r in runs))}; "
              f"compile per schema {', '.join(_ms(c) for c in compiles)}; "
              f"mask for a batch of {args.batch}: {_ms(fill)} ({1e6 * fill / args.batch:.0f} us a row) "
              f"(medians of {args.repeats})")


if __name__ == "__main__":
    main()
