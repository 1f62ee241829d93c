"""The API surface real clients use: every field either changes the result as it should, or is
refused with a 400 naming it; output constraints; /tokenize, /detokenize, /version, HEAD
/health, x-request-id and /openapi.json. (/v1/responses: test_responses_api.py.)"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

import backfill
from tests.server.harness import API_KEY, MODEL, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
C, CH = "/v1/completions", "/v1/chat/completions"
PROMPT = "The three most important inventions in history are"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONTINUED = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **fields}


def post(server: ServerProcess, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers={**AUTH, **kwargs.pop("headers", {})},
                      timeout=120, **kwargs)


# (case id, path, body, the error's param)
REFUSED: list[tuple[str, str, dict[str, Any], str]] = [
    ("prompt-logprobs-streamed", C, completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("prompt-logprobs-over-20", C, completion(prompt_logprobs=21), "prompt_logprobs"),
    ("logits-processors", C, completion(logits_processors=["my.module:Processor"]), "logits_processors"),
    ("beam-search", C, completion(use_beam_search=True), "use_beam_search"),
    ("allowed-token-ids-empty", C, completion(allowed_token_ids=[]), "allowed_token_ids"),
    ("top-k-past-int64", C, completion(top_k=2**70), "top_k"),
    ("allowed-all-bad-words", C, completion(allowed_token_ids=[28], bad_words=[","]), "allowed_token_ids"),  # 28: ","
    ("allowed-stop-under-min-tokens", CH, chat(allowed_token_ids=[2], min_tokens=4), "allowed_token_ids"),  # 2: EOS
    ("truncate-zero", C, completion(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ("truncate-below-minus-one", CH, chat(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ("truncate-over-context", C, completion(truncate_prompt_tokens=10**6), "truncate_prompt_tokens"),
    ("allowed-token-ids-outside", CH, chat(allowed_token_ids=[1, 10**9]), "allowed_token_ids"),
    ("bad-words-blank", CH, chat(bad_words=["Paris", " "]), "bad_words"),
    ("bad-words-too-many", C, completion(bad_words=["w"] * 129), "bad_words"),
    ("whitespace-pattern", C, completion(guided_json={"type": "object"}, guided_whitespace_pattern=" "),
     "guided_whitespace_pattern"),
    ("structural-tag", CH, chat(structural_tag={"structures": []}), "structural_tag"),
    ("decoding-backend", C, completion(guided_regex="a+", guided_decoding_backend="xgrammar"),
     "guided_decoding_backend"),
    ("chat-echo", CH, chat(echo=True), "echo"),
    ("chat-own-template", CH, chat(chat_template="{{ messages }}"), "chat_template"),
    ("chat-documents", CH, chat(documents=[{"title": "a", "text": "b"}]), "documents"),
    ("chat-prediction", CH, chat(prediction={"type": "content", "content": "Paris"}), "prediction"),
    ("chat-audio", CH, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("chat-reasoning-effort", CH, chat(reasoning_effort="low"), "reasoning_effort"),
    ("chat-verbosity", CH, chat(verbosity="low"), "verbosity"),
    ("chat-web-search", CH, chat(web_search_options={}), "web_search_options"),
    # Output constraints: one at most, well-formed, and accepted by the grammar engine.
    ("response-format-type", CH, chat(response_format={"type": "grammar"}), "response_format.type"),
    ("json-schema-missing", CH, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    ("json-schema-bad", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), "response_format.json_schema.schema"),
    ("two-constraints", C, completion(guided_regex="a+", guided_choice=["a"]), "guided_choice"),
    ("format-and-guided", CH, chat(response_format={"type": "json_object"}, guided_json={"type": "object"}),
     "guided_json"),
    ("guided-json-text", C, completion(guided_json="{not json"), "guided_json"),
    ("guided-regex-bad", C, completion(guided_regex="(unclosed"), "guided_regex"),
    ("guided-grammar-bad", C, completion(guided_grammar="start: ("), "guided_grammar"),
    ("guided-choice-empty", C, completion(guided_choice=[]), "guided_choice"),
    ("structured-two", C, completion(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    ("structured-none", C, completion(structured_outputs={}), "structured_outputs"),
    ("structured-regex-bad", CH, chat(structured_outputs={"regex": "(unclosed"}), "structured_outputs.regex"),
    ("structured-json-type", C, completion(structured_outputs={"json": 5}), "structured_outputs.json"),
    ("structured-tag", C, completion(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag"),
    # Chat template controls.
    ("continue-with-generation-prompt", CH, chat(messages=CONTINUED, continue_final_message=True),
     "continue_final_message"),
    ("continue-a-user-message", CH, chat(continue_final_message=True, add_generation_prompt=False),
     "continue_final_message"),
    ("template-kwargs-reserved", CH, chat(chat_template_kwargs={"add_generation_prompt": False}),
     "chat_template_kwargs"),
    ("template-kwargs-messages", CH, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("template-kwargs-hf-option", CH, chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    ("template-kwargs-not-object", CH, chat(chat_template_kwargs=["x"]), "chat_template_kwargs"),
    # Utility endpoints.
    ("tokenize-both", "/tokenize", {"prompt": "a", "messages": QUESTION}, "messages"),
    ("tokenize-neither", "/tokenize", {}, "prompt"),
    ("tokenize-chat-special", "/tokenize", {"messages": QUESTION, "add_special_tokens": True}, "add_special_tokens"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": ["a"]}, "tokens[0]"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[case[0] for case in REFUSED])
def test_refused_fields_are_named(server: ServerProcess, case: tuple[str, str, dict[str, Any], str]) -> None:
    _, path, body, param = case
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(param), error


RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}  # no finite output


@pytest.mark.parametrize("body", [
    completion(guided_json=RECURSIVE),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}),
    completion(guided_regex="a{700000}"),  # past the lexer's limits once the first token is taken
    chat(guided_choice=["yes"], allowed_token_ids=[28]),  # the choice's tokens are not allowed
], ids=["recursive-schema", "recursive-response-format", "huge-repeat", "choice-not-allowed"])
def test_a_constraint_that_cannot_be_met_is_a_400_not_an_output(server: ServerProcess, body: dict[str, Any]) -> None:
    path = CH if "messages" in body else C
    for _ in range(2):  # found while decoding, then (the grammar engine's state is cached) maybe at once
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error", response.text
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    if response.status_code == 200:  # found while decoding: the stream ends with the error
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines
        assert not any('"finish_reason":"stop"' in line or '"finish_reason":"abort"' in line for line in lines)
    else:
        assert response.status_code == 400


def test_fields_that_ask_for_nothing_are_accepted(server: ServerProcess) -> None:
    off = {"use_beam_search": False, "bad_words": [], "logits_processors": [],
           "guided_decoding_backend": "auto", "user": "u", "store": False, "metadata": {"a": "b"},
           "service_tier": "auto", "response_format": {"type": "text"}, "echo": False, "reasoning_effort": None}
    response = post(server, CH, chat(**off))
    assert response.status_code == 200, response.text


def test_include_stop_str_in_output(server: ServerProcess) -> None:
    body = completion(max_tokens=16, temperature=0, ignore_eos=True)
    text = post(server, C, body).json()["choices"][0]["text"]
    stop = text.split()[len(text.split()) // 2]
    cut = text[: text.index(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        choice = post(server, C, {**body, "stop": [stop], "include_stop_str_in_output": include}).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
    with httpx.stream("POST", server.v1 + "/completions", headers=AUTH, timeout=120,
                      json={**body, "stop": [stop], "include_stop_str_in_output": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut + stop
    # vLLM's stop_reason: what stopped it, in the chunk that says it stopped (and only there)
    assert [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks if c["choices"]][-1] \
        == ("stop", stop)
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1] if c["choices"])
    assert post(server, C, body).json()["choices"][0]["stop_reason"] is None  # cut by max_tokens


def test_chat_stop_reason_names_the_stop_string(server: ServerProcess) -> None:
    body = chat(max_tokens=16, temperature=0, ignore_eos=True)
    text = post(server, CH, body).json()["choices"][0]["message"]["content"]
    stop = text.split()[len(text.split()) // 2]
    choice = post(server, CH, {**body, "stop": [stop]}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    with httpx.stream("POST", server.v1 + "/chat/completions", headers=AUTH, timeout=120,
                      json={**body, "stop": [stop], "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finals = [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == [("stop", stop)]


def test_skip_special_tokens(server: ServerProcess) -> None:
    end = tokenize(server, prompt="<|im_end|>", add_special_tokens=False)["tokens"]
    body = completion(max_tokens=2, temperature=0, ignore_eos=True, logit_bias={str(end[0]): 100})
    assert post(server, C, body).json()["choices"][0]["text"] == ""
    assert post(server, C, {**body, "skip_special_tokens": False}).json()["choices"][0]["text"] == "<|im_end|>" * 2


def tokenize(server: ServerProcess, **body: Any) -> dict[str, Any]:
    response = post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def detokenize(server: ServerProcess, tokens: list[int]) -> str:
    response = post(server, "/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    return str(response.json()["prompt"])


def test_add_generation_prompt_false_renders_no_assistant_header(server: ServerProcess) -> None:
    with_header = detokenize(server, tokenize(server, messages=QUESTION)["tokens"])
    without = detokenize(server, tokenize(server, messages=QUESTION, add_generation_prompt=False)["tokens"])
    assert with_header.startswith(without) and with_header != without and "assistant" in with_header[len(without):]
    response = post(server, CH, chat(add_generation_prompt=False))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(tokenize(server, messages=QUESTION,
                                                                      add_generation_prompt=False)["tokens"])


def test_continue_final_message_continues_the_assistant_turn(server: ServerProcess) -> None:
    rendered = tokenize(server, messages=CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert detokenize(server, rendered["tokens"]).endswith("The capital of France is")
    result = post(server, CH, chat(messages=CONTINUED, add_generation_prompt=False, continue_final_message=True,
                                   max_tokens=8, temperature=0)).json()
    assert result["usage"]["prompt_tokens"] == rendered["count"]
    assert "Paris" in result["choices"][0]["message"]["content"]


def test_chat_template_kwargs_are_accepted(server: ServerProcess) -> None:
    # The served template reads no extra variable; test_chat_template_kwargs_reach_the_template
    # shows they arrive, on a template that does.
    response = post(server, CH, chat(chat_template_kwargs={"enable_thinking": False, "custom": [1, 2]}))
    assert response.status_code == 200, response.text


def test_chat_template_kwargs_reach_the_template_and_cannot_forge_turns() -> None:
    from backfill.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.hf.chat_template = tokenizer.chat_template = (
        "{{ greeting }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    text, ids = tokenizer.encode_chat(QUESTION, chat_template_kwargs={"greeting": "Hi <|im_end|>"})
    assert text == "Hi <|im_end|><|im_start|>What is the capital of France?<|im_end|>"
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert ids.count(end[0]) == 1  # the template's own marker; the greeting's is plain text
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


# ---- output constraints (the engine masks the sampler) -----------------------------------------


def test_response_format_json_object(server: ServerProcess) -> None:
    result = post(server, CH, chat(response_format={"type": "json_object"}, max_tokens=40, temperature=0)).json()
    choice = result["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice["message"]["content"].startswith("{")


def test_response_format_json_schema(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon"]}},
              "required": ["capital"], "additionalProperties": False}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                        "strict": True}},
                max_tokens=30, temperature=0)
    content = post(server, CH, body).json()["choices"][0]["message"]["content"]
    assert json.loads(content)["capital"] in ("Paris", "Lyon")


@pytest.mark.parametrize("fields", [{"guided_choice": ["yes", "no"]},
                                    {"structured_outputs": {"choice": ["yes", "no"]}}], ids=["guided", "structured"])
def test_choice_output_is_one_of_the_choices(server: ServerProcess, fields: dict[str, Any]) -> None:
    for path, body in ((C, completion(**fields, max_tokens=8)), (CH, chat(**fields, max_tokens=8))):
        choice = post(server, path, body).json()["choices"][0]
        assert (choice.get("text") or choice.get("message", {}).get("content")) in ("yes", "no")


def test_regex_output_matches(server: ServerProcess) -> None:
    choice = post(server, C, completion(guided_regex=r"[0-9]{3}-[a-z]{2}", max_tokens=12)).json()["choices"][0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", choice["text"]), choice


def test_the_api_server_process_never_loads_torch(server: ServerProcess) -> None:
    """Checking constraints, chat templates and tools (the engine core, another process, runs
    the model): loading torch there took ~2.5 s holding the GIL, every stream stalled."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body in (chat(response_format={"type": "json_object"}, max_tokens=4),
                 chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                      max_tokens=4),
                 chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                      tool_choice="required", max_tokens=8)):
        assert post(server, CH, body).status_code == 200
    assert post(server, C, completion(guided_regex="[a-z]+", max_tokens=4)).status_code == 200
    with open(f"/proc/{server.process.pid}/maps") as maps:
        assert "libtorch" not in maps.read()


# ---- utility endpoints -------------------------------------------------------------------------


def test_tokenize_counts_what_completions_count(server: ServerProcess) -> None:
    result = tokenize(server, prompt=PROMPT, return_token_strs=True)
    usage = post(server, C, completion(max_tokens=1)).json()["usage"]
    models = httpx.get(server.v1 + "/models", headers=AUTH).json()["data"]
    assert result["count"] == len(result["tokens"]) == len(result["token_strs"]) == usage["prompt_tokens"]
    assert result["max_model_len"] == models[0]["max_model_len"]
    assert detokenize(server, tokenize(server, prompt=PROMPT, add_special_tokens=False)["tokens"]) == PROMPT
    chat_usage = post(server, CH, chat(max_tokens=1)).json()["usage"]
    assert tokenize(server, messages=QUESTION)["count"] == chat_usage["prompt_tokens"]


def test_tokenize_renders_the_tools_the_chat_request_offers(server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    for choice in (None, "required", {"type": "function", "function": {"name": "get_weather"}}):
        fields = {"tools": tools, **({"tool_choice": choice} if choice is not None else {})}
        usage = post(server, CH, chat(max_tokens=1, **fields)).json()["usage"]
        assert tokenize(server, messages=QUESTION, **fields)["count"] == usage["prompt_tokens"]
    assert tokenize(server, messages=QUESTION, tools=tools)["count"] > tokenize(server, messages=QUESTION)["count"]
    for body, param in (({"prompt": "a", "tools": tools}, "tools"),
                        ({"messages": QUESTION, "tool_choice": {"type": "function", "function": {"name": "nope"}},
                          "tools": tools}, "tool_choice"),
                        ({"messages": QUESTION, "tools": [{"type": "function"}]}, "tools[0].function")):
        response = post(server, "/tokenize", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_version_and_head_health(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/version").json() == {"version": backfill.__version__}
    head = httpx.head(server.base_url + "/health")
    assert head.status_code == 200 and head.content == b""


def test_tokenize_needs_the_key_like_v1(server: ServerProcess) -> None:
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": [1]}).status_code == 401


@pytest.mark.parametrize("sent, echoed", [("req-42.a:b_C", True), ("x" * 129, False), ("bad id\u00e9", False),
                                          ("", False)])
def test_every_response_carries_a_request_id(server: ServerProcess, sent: str, echoed: bool) -> None:
    headers = {"x-request-id": sent.encode("utf-8")} if sent else {}
    for method, path, auth in (("GET", "/v1/models", AUTH), ("GET", "/v1/models", {}), ("GET", "/nope", AUTH),
                               ("GET", "/health", {})):
        response = httpx.request(method, server.base_url + path, headers={**auth, **headers})  # type: ignore[arg-type]
        request_id = response.headers["x-request-id"]
        assert request_id == sent if echoed else re.fullmatch(r"[0-9a-f]{32}", request_id), (path, request_id)


def test_openapi_shows_the_request_schemas(server: ServerProcess) -> None:
    spec = httpx.get(server.base_url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in ((C, "CompletionRequest"), (CH, "ChatCompletionRequest"), ("/v1/responses", "ResponsesRequest"),
                       ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    assert {"messages", "response_format", "continue_final_message"} <= set(schemas["ChatCompletionRequest"]["properties"])
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec))
    assert set(refs) <= set(schemas)


def test_allowed_token_ids_are_all_that_is_sampled(server: ServerProcess) -> None:
    ids = [post(server, "/tokenize", {"prompt": word, "add_special_tokens": False}).json()["tokens"]
           for word in (" yes", " no")]
    assert all(len(token_ids) == 1 for token_ids in ids)
    allowed = [token_ids[0] for token_ids in ids]
    body = completion(prompt="Is the sky blue? Answer:", max_tokens=5, temperature=1.0, n=4, seed=1,
                      allowed_token_ids=allowed, logprobs=0)
    response = post(server, C, body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["logprobs"]["tokens"] and set(choice["logprobs"]["tokens"]) <= {" yes", " no"}
        assert choice["text"] == "".join(choice["logprobs"]["tokens"])


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: ServerProcess) -> None:
    prompt = "one two three four five six seven eight nine ten"
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    body = completion(prompt=prompt, max_tokens=2, temperature=0, echo=True, truncate_prompt_tokens=4)
    result = post(server, C, body).json()
    kept = post(server, "/detokenize", {"tokens": ids[-4:]}).json()["prompt"]
    assert result["usage"]["prompt_tokens"] == 4 and result["choices"][0]["text"].startswith(kept)
    alone = post(server, C, completion(prompt=ids[-4:], max_tokens=2, temperature=0)).json()
    assert result["choices"][0]["text"] == kept + alone["choices"][0]["text"]
    # -1: whatever the context leaves after max_tokens (a prompt longer than the context is cut).
    context = httpx.get(server.v1 + "/models", headers=AUTH).json()["data"][0]["max_model_len"]
    stop_at_once = {"allowed_token_ids": [ids[2]], "stop_token_ids": [ids[2]]}  # one token, whatever max_tokens
    long = post(server, C, completion(prompt=[ids[1]] * (context + 100), max_tokens=context - 16,
                                      truncate_prompt_tokens=-1, **stop_at_once))
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 16
    chat_body = chat(truncate_prompt_tokens=5, max_tokens=1)
    assert post(server, CH, chat_body).json()["usage"]["prompt_tokens"] == 5


def test_bad_words_are_never_generated(server: ServerProcess) -> None:
    body = chat(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
                temperature=0)
    assert "Paris" in post(server, CH, body).json()["choices"][0]["message"]["content"]
    for words in (["Paris"], ["Paris", "capital of"]):
        text = post(server, CH, {**body, "bad_words": words}).json()["choices"][0]["message"]["content"]
        assert text and not any(word in text for word in words), text


def test_return_tokens_as_token_ids(server: ServerProcess) -> None:
    fields = {"max_tokens": 4, "temperature": 0, "return_tokens_as_token_ids": True}
    text_form = post(server, C, completion(max_tokens=4, temperature=0, logprobs=2)).json()["choices"][0]
    result = post(server, C, completion(logprobs=2, echo=True, **fields)).json()["choices"][0]
    tokens = result["logprobs"]["tokens"]
    ids = [int(token.removeprefix("token_id:")) for token in tokens]
    assert all(token.startswith("token_id:") for token in tokens)
    shown = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert shown == result["text"] and result["text"].endswith(text_form["text"])
    assert all(key.startswith("token_id:") for top in result["logprobs"]["top_logprobs"][1:] for key in top)
    chat_result = post(server, CH, chat(logprobs=True, top_logprobs=1, **fields)).json()["choices"][0]
    for entry in chat_result["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())
        assert all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])


def test_n_sequences_with_a_stop_string_each_match_their_single_request(server: ServerProcess) -> None:
    # A sequence a stop string ends in the front end runs on in the core until the abort lands:
    # those tokens must not reach it (nor break the other sequences' outputs in the same message).
    body = completion(prompt="Once upon a time", max_tokens=40, temperature=1, seed=5, stop=["e"], logprobs=0)
    singles = [post(server, C, {**body, "seed": 5 + i}).json()["choices"][0] for i in range(4)]
    for _ in range(2):
        answer = post(server, C, {**body, "n": 4}).json()
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        assert [(c["text"], c["finish_reason"]) for c in choices] == [(s["text"], s["finish_reason"]) for s in singles]
        assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    assert sum(s["finish_reason"] == "stop" for s in singles) >= 2, singles  # the case under test happened ("e": any text)


def test_a_stop_token_s_text_is_left_out_unless_asked_for(server: ServerProcess) -> None:
    body = completion(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    tokens = post(server, C, {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]["tokens"]
    texts = post(server, C, body).json()["choices"][0]["logprobs"]["tokens"]
    stop_id = int(tokens[2].removeprefix("token_id:"))
    assert stop_id not in [int(t.removeprefix("token_id:")) for t in tokens[:2]]
    for include, expected in ((False, "".join(texts[:2])), (True, "".join(texts[:3]))):
        choice = post(server, C, {**body, "stop_token_ids": [stop_id], "include_stop_str_in_output": include}).json()
        assert (choice["choices"][0]["text"], choice["choices"][0]["finish_reason"]) == (expected, "stop")
        assert choice["choices"][0]["stop_reason"] == stop_id
        assert choice["usage"]["completion_tokens"] == 3


def test_min_tokens_holds_off_stop_strings(server: ServerProcess) -> None:
    body = completion(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    texts = post(server, C, body).json()["choices"][0]["logprobs"]["tokens"]
    stop = texts[1]  # ends the output at its second token
    assert post(server, C, {**body, "stop": [stop]}).json()["usage"]["completion_tokens"] == 2
    answer = post(server, C, {**body, "stop": [stop], "min_tokens": 6}).json()
    assert answer["usage"]["completion_tokens"] >= 6
    assert answer["choices"][0]["text"].startswith("".join(texts[:6]))


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(server: ServerProcess) -> None:
    # ~3 MB of text: more characters than max_model_len tokens can cover (the longest token of
    # SmolLM2's vocabulary is 81 characters), refused without the seconds of tokenizing it
    models = httpx.get(server.v1 + "/models", headers=AUTH).json()["data"]
    text = "ab " * (models[0]["max_model_len"] * 81 * 4 // 3 + 1)
    for path, body, param in ((C, completion(prompt=text), "prompt"),
                              (CH, chat(messages=[{"role": "user", "content": text}]), "messages"),
                              ("/tokenize", {"prompt": text}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages")):
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded") and "characters" in error["message"]
    # with truncation the prompt is tokenized and its last tokens kept
    response = post(server, C, completion(prompt=text[:400_000], truncate_prompt_tokens=16, max_tokens=1))
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 16, response.text
