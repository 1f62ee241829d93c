"""Constrained decoding in the engine: outputs match their grammar under every sampling mode,
with n > 1 and preemption; a slow compile holds back only its own request."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from backfill.engine.llm import LLM
from backfill.engine.messages import EngineCoreRequest
from backfill.sampling_params import SamplingParams
from backfill.sampling_params import StructuredOutputsParams as Structured
from tests.fresh_python import run_python

PERSON = {
    "type": "object",
    # Bounded (lengths, range, items), so that every output ends within max_tokens: the grammar
    # makes any output valid; a model that repeats itself (greedy "tea", "tea", ...) stops at
    # the bound.
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "likes": {"type": "array", "items": {"type": "string", "enum": ["tea", "cats", "rain"]},
                             "maxItems": 3}},
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}


def _valid_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "likes"} and isinstance(value["name"], str) and len(value["name"]) <= 20
            and isinstance(value["age"], int) and 0 <= value["age"] <= 150 and len(value["likes"]) <= 3 and all(item in ("tea", "cats", "rain") for item in value["likes"]))


SAMPLING = {
    "greedy": {"temperature": 0.0},
    "t0.8": {"temperature": 0.8},
    "top_k_top_p_min_p": {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    "penalties_bias": {"temperature": 0.8, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                       "presence_penalty": 0.5, "logit_bias": {90: 50.0}},
    "min_tokens_seed_logprobs": {"temperature": 0.8, "seed": 7, "min_tokens": 3, "logprobs": 2},
}


@pytest.mark.parametrize("sampling", list(SAMPLING.values()), ids=list(SAMPLING))
def test_json_schema_output_always_validates(llm_fp32: LLM, sampling: dict) -> None:
    # max_tokens covers the schema's worst case (each name character a 6-token unicode escape)
    params = SamplingParams(max_tokens=300, n=4, structured_outputs=Structured(json=PERSON), **sampling)
    prompts = ["Describe a person as JSON.", "Hello!", "1 2 3"]
    for output in llm_fp32.generate(prompts, params):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            assert _valid_person(completion.text), completion.text


def test_choice_regex_grammar_json_object(llm_fp32: LLM) -> None:
    cases = [
        (Structured(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
        (Structured(regex=r"[0-9]{3}-[A-Z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        (Structured(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\(([0-9]{1,3})(,[0-9]{1,3})*\)", t)),
        (Structured(grammar='root ::= "x" [0-9]{2}'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),  # GBNF
    ]
    for structured, check in cases:
        params = SamplingParams(max_tokens=60, temperature=0.9, n=3, seed=1, structured_outputs=structured)
        for completion in llm_fp32.generate(["Answer:"], params)[0].outputs:
            assert completion.finish_reason == "stop" and check(completion.text), (structured, completion.text)
    # Any JSON object: unbounded, so a rambling model may hit max_tokens (then a prefix of one).
    params = SamplingParams(max_tokens=60, temperature=0.9, n=4, seed=1, structured_outputs=Structured(json_object=True))
    for completion in llm_fp32.generate(['Reply in JSON, like {"answer": "..."}. What is 2+2?'], params)[0].outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict), completion.text
        else:
            assert completion.finish_reason == "length" and completion.text.startswith("{"), completion.text


def test_grammar_ends_the_output_without_eos_and_max_tokens_truncates(llm_fp32: LLM) -> None:
    done = llm_fp32.generate(["Pick:"], SamplingParams(max_tokens=20, temperature=0,
                                                        structured_outputs=Structured(choice=["alpha"])))[0].outputs[0]
    assert (done.text, done.finish_reason) == ("alpha", "stop")
    # ignore_eos cannot make a complete grammar go on: the output is complete
    done = llm_fp32.generate(["Pick:"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                        structured_outputs=Structured(choice=["alpha"])))[0].outputs[0]
    assert (done.text, done.finish_reason) == ("alpha", "stop")
    cut = llm_fp32.generate(["Count:"], SamplingParams(max_tokens=5, temperature=0,
                                                       structured_outputs=Structured(regex="[a-z]+")))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and re.fullmatch("[a-z]+", cut.text)


def test_constrained_greedy_output_is_batch_invariant_and_unconstrained_rows_unchanged(llm_fp32: LLM) -> None:
    constrained = SamplingParams(max_tokens=60, temperature=0, structured_outputs=Structured(json=PERSON))
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm_fp32.generate(["Describe a person as JSON."], constrained)[0].outputs[0].text
    free_alone = llm_fp32.generate(["The capital of France is"], free)[0].outputs[0].text
    mixed = llm_fp32.generate(["The capital of France is", "Describe a person as JSON.", "Hi"],
                              [free, constrained, free])
    assert mixed[1].outputs[0].text == alone
    assert mixed[0].outputs[0].text == free_alone


def test_preempted_constrained_requests_still_match() -> None:
    # 12 blocks of 16 tokens cannot hold 8 requests growing to ~100 tokens: some are preempted
    # and recomputed, their matchers untouched.
    llm = LLM(dtype="float32", max_num_seqs=8, num_kv_blocks=12, prefill_budget=0)
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=3, structured_outputs=Structured(json=PERSON))
    outputs = llm.generate([f"Person number {i} as JSON:" for i in range(8)], params)
    assert llm.engine.num_preemptions_total > 0
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "length" or _valid_person(completion.text), completion


def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(llm_fp32: LLM) -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: .*regex"):
        llm_fp32.generate(["x"], SamplingParams(structured_outputs=Structured(regex="(")))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
        llm_fp32.generate(["x"], SamplingParams(structured_outputs=Structured(json={"type": "nonsense"})))
    with pytest.raises(ValueError, match=r"^structured_outputs: set exactly one"):
        Structured(regex="a", choice=["a"])


def _core_request(request_id: str, prompt: list[int], params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, params=params, eos_token_ids=(2,),
                             arrival_time=time.monotonic())


def test_a_slow_compile_does_not_delay_other_requests(llm_fp32: LLM) -> None:
    core = llm_fp32.engine.core
    manager = core.structured_output
    release = threading.Event()
    compile_real = manager._compile

    def slow_compile(params):  # a grammar that takes as long as the test wants to compile
        assert release.wait(60)
        return compile_real(params)

    manager._compile = slow_compile  # type: ignore[method-assign]
    try:
        prompt = llm_fp32.tokenizer.encode("Tell me about cats.")
        core.add_request(_core_request("slow", prompt, SamplingParams(
            max_tokens=30, temperature=0, structured_outputs=Structured(regex="[a-z ]{1,40}\\."))))
        core.add_request(_core_request("free", prompt, SamplingParams(max_tokens=10, temperature=0)))
        tokens: dict[str, list[int]] = {"slow": [], "free": []}
        finished = set()
        for _ in range(10):  # "free" runs to its end while "slow" still compiles
            for output in core.step()[0]:
                tokens[output.request_id] += output.new_token_ids
                if output.finish_reason is not None:
                    finished.add(output.request_id)
        assert finished == {"free"} and len(tokens["free"]) == 10
        assert tokens["slow"] == [] and core.scheduler.get_request("slow").num_computed_tokens == 0
        release.set()
        for _ in range(200):
            for output in core.step()[0]:
                tokens[output.request_id] += output.new_token_ids
                if output.finish_reason is not None:
                    finished.add(output.request_id)
            if "slow" in finished:
                break
        text = llm_fp32.tokenizer.decode(tokens["slow"])
        assert re.fullmatch(r"[a-z ]{1,40}\.", text), text
    finally:
        manager._compile = compile_real  # type: ignore[method-assign]
        release.set()


def test_a_constraint_no_allowed_token_meets_ends_with_the_tokens_it_accepted(
        llm_fp32: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """allowed_token_ids that leave the grammar no token after "aaaa": the sequence ends
    "constraint" with the tokens the grammar accepted, never the one it rejected, and the log
    says why in one bounded line (llguidance's message goes on with the user's grammar)."""
    [a] = llm_fp32.tokenizer.encode("a", add_special_tokens=False)
    grammar = "(a|b){4}c" + "|(\n2026-01-01 ERROR forged line)" * 40  # the rest is never reached
    params = SamplingParams(max_tokens=16, structured_outputs=Structured(regex=grammar), allowed_token_ids=[a])
    with caplog.at_level("WARNING", logger="backfill.core.scheduler"):
        [output] = llm_fp32.generate(["Say a"], params)
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.text, completion.token_ids) == ("constraint", "aaaa", [a] * 4)
    [record] = [r for r in caplog.records if "output constraint failed" in r.getMessage()]
    message = record.getMessage()
    assert "\n" not in message and "forged" not in message and len(message) < 400, message


def test_a_grammar_that_fails_in_the_core_ends_its_request(llm_fp32: LLM) -> None:
    """The front ends check grammars first; the core still ends one that fails ("constraint":
    the server answers with an error)."""
    core = llm_fp32.engine.core
    core.add_request(_core_request("bad", [1, 2, 3], SamplingParams(structured_outputs=Structured(regex="("))))
    for _ in range(400):
        outputs = core.step()[0]
        if outputs:
            break
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [("bad", "constraint", [])]
    assert core.scheduler.get_request("bad") is None and not core.has_unfinished_requests()


def test_checking_a_constraint_needs_no_torch() -> None:
    """The API server's process checks each constraint before queuing it (GrammarCompiler.check)
    and never imports torch: importing it there on the first constrained request took ~2.5 s
    holding the GIL, and every stream the server was sending stalled meanwhile."""
    code = (
        "import sys\n"
        "from backfill.sampling_params import StructuredOutputsParams as S\n"
        "from backfill.structured_output.compiler import GrammarCompiler\n"
        "from backfill.tokenizer import load_tokenizer\n"
        "compiler = GrammarCompiler(load_tokenizer(None), 49152)\n"
        "compiler.check(S(json_object=True))\n"
        "compiler.check(S(json={'type': 'object', 'properties': {'a': {'type': 'integer'}}}))\n"
        "compiler.check(S(regex='[a-z]+'))\n"
        "compiler.check(S(choice=['yes', 'no']))\n"
        "try:\n"
        "    compiler.check(S(regex='('))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "assert 'torch' not in sys.modules, 'check imported torch'\n"
    )
    out = run_python(code)
    assert out.startswith("structured_outputs.regex: "), out


def test_the_first_constrained_step_does_not_import_dynamo() -> None:
    """The core fills grammar masks without llguidance.torch, whose import pulls in
    torch._dynamo (~1.5 s): on the first constrained step that held every running stream."""
    code = (
        "import sys\n"
        "from backfill.engine.llm import LLM\n"
        "from backfill.sampling_params import SamplingParams, StructuredOutputsParams as S\n"
        "llm = LLM()\n"
        "before = set(sys.modules)\n"
        "out = llm.generate(['Hi'], SamplingParams(max_tokens=8, structured_outputs=S(json_object=True)))\n"
        "print(out[0].outputs[0].text[:1])\n"
        "new = set(sys.modules) - before\n"
        "assert 'llguidance.torch' not in new and not [m for m in new if m.startswith('torch._dynamo')], new\n"
    )
    out = run_python(code)
    assert out.strip() == "{", out
