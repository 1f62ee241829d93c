"""OutputProcessor: what it does with outputs the core sent for sequences the front end already
ended, and with a sequence whose output cannot be applied."""

from __future__ import annotations

import pytest

from backfill.engine.messages import CoreInfo, EngineCoreOutput
from backfill.engine.output_processor import OutputProcessor
from backfill.engine.processor import InputProcessor
from backfill.sampling_params import SamplingParams
from backfill.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def processors(tokenizer: Tokenizer) -> tuple[InputProcessor, OutputProcessor]:
    info = CoreInfo("m", 2048, 49152, (2,), 8, 64)
    return InputProcessor(tokenizer, info), OutputProcessor(tokenizer.hf)


def out(core_id: str, text: str, tokenizer: Tokenizer) -> EngineCoreOutput:
    return EngineCoreOutput(core_id, tokenizer.encode(text, add_special_tokens=False), 1.0)


def test_tokens_after_a_stop_string_are_not_part_of_the_output(tokenizer: Tokenizer) -> None:
    inputs, outputs = processors(tokenizer)
    params = SamplingParams(max_tokens=50, n=2, seed=1, stop=["b"])
    outputs.add(inputs.process("r", "hi", params, 0.0))
    first, stopped = outputs.process([out("r#0", "ab", tokenizer), out("r#1", "a", tokenizer)])
    assert stopped == ["r#0"] and first[0].outputs[0].text == "a"
    # the core ran r#0 one more step before its abort landed
    later, stopped = outputs.process([out("r#0", " more", tokenizer), out("r#1", "c", tokenizer)])
    assert stopped == [] and [(c.index, c.text) for c in later[0].outputs] == [(1, "ac")]
    final, _ = outputs.process([EngineCoreOutput("r#1", [2], 2.0, finish_reason="stop", stop_token_id=2)])
    assert final[0].finished
    assert [(c.index, c.text, c.finish_reason, len(c.token_ids)) for c in final[0].outputs] == [(1, "ac", "stop", 3)]
    assert len(first[0].outputs[0].token_ids) == len(tokenizer.encode("ab", add_special_tokens=False))


def test_a_sequence_whose_output_fails_ends_alone(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs, outputs = processors(tokenizer)
    for name in ("bad", "good"):
        outputs.add(inputs.process(name, "hi", SamplingParams(max_tokens=50), 0.0))
    bad = outputs._sequences["bad"]  # noqa: SLF001
    monkeypatch.setattr(bad.detokenizer, "add_tokens", lambda ids: 1 / 0)
    results, stopped = outputs.process([out("bad", "x", tokenizer), out("good", "y", tokenizer)])
    assert stopped == ["bad"]
    by_id = {r.request_id: r for r in results}
    assert by_id["bad"].finished and by_id["bad"].outputs[0].finish_reason == "abort"
    assert by_id["good"].outputs[0].text == "y" and not by_id["good"].finished
