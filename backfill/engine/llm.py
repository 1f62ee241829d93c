"""LLM: the offline, batch-in batch-out API over LLMEngine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from backfill.config import EngineConfig
from backfill.engine.llm_engine import LLMEngine
from backfill.outputs import RequestOutput
from backfill.sampling_params import SamplingParams
from backfill.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    """Generate for many prompts at once; all of them are scheduled together.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model` and `kwargs` are EngineConfig's fields (an invalid one raises ValueError)."""
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"params: got {len(param_list)} for {len(prompt_list)} prompts")
        request_ids = [f"gen-{next(self._counter)}" for _ in prompt_list]
        try:
            for request_id, prompt, request_params in zip(request_ids, prompt_list, param_list):
                self.engine.add_request(request_id, prompt, request_params)
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        conversations: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. Special-token
        text inside messages is encoded as text (`Tokenizer.encode_chat`)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts: list[Prompt] = []
        for messages in conversations:
            prompts.append(self.tokenizer.encode_chat(messages, add_generation_prompt=True)[1])  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        # Outputs of an n > 1 request arrive per completion: keep the latest of each.
        latest: dict[str, dict[int, object]] = {request_id: {} for request_id in request_ids}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                for completion in output.outputs:
                    latest[output.request_id][completion.index] = completion
                if output.finished:
                    output.outputs = [latest[output.request_id][i] for i in sorted(latest[output.request_id])]  # type: ignore[misc]
                    finished[output.request_id] = output
                    progress.update(1)
        progress.close()
        return [finished[request_id] for request_id in request_ids]
