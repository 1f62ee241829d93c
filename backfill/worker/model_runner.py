"""ModelRunner: owns the weights, the paged KV cache and the sampler; runs one step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from backfill.config import ConfigError, EngineConfig, default_num_kv_blocks
from backfill.core.outputs import ModelRunnerOutput, SchedulerOutput
from backfill import kernels
from backfill.model.cpu_decoder import CpuDecoder, unsupported_reason
from backfill.model.llama import LlamaForCausalLM
from backfill.model.loader import kv_cache_torch_dtype, load_model, load_stored_weights, resolve_dtype
from backfill.model.prepack import prepack_supported
from backfill.model.static_decode import varlen_supported
from backfill.worker.cuda_graph import CudaGraphRunner, DecodeInputs, decode_inputs
from backfill.worker.host_allocator import keep_freed_memory
from backfill.worker.input_batch import build_batch, padding_rows
from backfill.worker.prompt_logprobs import PromptLogprobs
from backfill.worker.sampler import Sampler

if TYPE_CHECKING:
    from backfill.structured_output.manager import GrammarBitmask

logger = logging.getLogger(__name__)


def wants_cpu_kernels(config: EngineConfig) -> bool:
    """Whether `config` asks for the CPU kernels' fused decoder (weights as stored, float32
    activations); it runs where the extension is built and supports the model."""
    return config.quantization != "none" and config.device == "cpu" and config.dtype in ("auto", "float32")


def compute_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype an engine of `config` computes in (activations and KV cache), for a model the
    CPU kernels support: float32 on the kernels, else `config.dtype` ("auto": the device's fast
    dtype). A loaded runner's `dtype` is the fact."""
    if wants_cpu_kernels(config) and kernels.available():
        return torch.float32
    return resolve_dtype(config.dtype, torch.device(config.device))


class ModelRunner:
    """The data plane of the engine: tensors live here and nowhere else.

    `execute()` takes a plain `SchedulerOutput` and returns a plain `ModelRunnerOutput`; the
    KV cache it writes is addressed only through the block ids the scheduler hands out.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's [S, V] temporaries reuse the last step's pages
        self.model: LlamaForCausalLM | CpuDecoder = self._load_model()
        self.dtype = torch.float32 if isinstance(self.model, CpuDecoder) else resolve_dtype(config.dtype, self.device)
        self.kv_dtype = self._kv_cache_dtype()
        self.model_config = self.model.config
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or self._default_num_kv_blocks()
        self.max_model_len = self._fit_max_model_len()
        # One block more than the scheduler knows: the scratch block of padding rows.
        self.scratch_block = self.num_kv_blocks
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks + 1)
        self.sampler = Sampler(
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            device=self.device,
            seed=config.seed,
        )
        self.prompt_logprobs = PromptLogprobs()
        # Steps of decodes only on the CPU kernels run from plain lists (_execute_decodes); False:
        # through build_batch as every other step (tests compare the two).
        self.fast_decodes = True
        self.graph_runner: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager and isinstance(self.model, LlamaForCausalLM):
            self.graph_runner = self._capture_graphs()

    def _capture_graphs(self) -> CudaGraphRunner:
        """Decode graphs over flash attention reading the paged cache where it runs here (see
        model/static_decode.py), else over the portable gather kernel."""
        cfg = self.model_config
        reason = varlen_supported(self.device, self.dtype, self.block_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim)
        if reason is None and self.kv_dtype != self.dtype:
            reason = f"the KV cache is {self.kv_dtype}, the activations {self.dtype}"
        if reason is not None:
            logger.info("decode graphs use the gather attention kernel: %s", reason)
        runner = CudaGraphRunner(self.model, self.kv_caches, self.config.max_num_seqs,  # type: ignore[arg-type]
                                 self.max_model_len, self.scratch_block, "gather" if reason else "varlen")
        runner.capture()
        return runner

    def _load_model(self) -> LlamaForCausalLM | CpuDecoder:
        """The CPU kernels' fused decoder over weights as stored where they apply (CPU, fp32
        activations, the extension built), else the plain-PyTorch model (the reference, and the
        GPU path), in `dtype` with its weights expanded."""
        config = self.config
        if wants_cpu_kernels(config):
            model_config, state = load_stored_weights(config.model, config.quantization) if kernels.available() else (None, None)
            reason = "the CPU kernels extension is not available" if model_config is None else unsupported_reason(model_config)
            if reason is None:
                decoder = CpuDecoder(model_config, state,  # type: ignore[arg-type]
                                     activation_quantization=config.activation_quantization)
                logger.info("CPU kernels (%s): %.1f MB of weights read per step", decoder.kernels,
                            decoder.weight_bytes_per_step / 1e6)
                if config.activation_quantization != "none" and decoder.int8_activation_matrices == 0:
                    logger.warning("activation_quantization=%r: no linear of this model is stored in a 4-bit type "
                                   "(Q4_0, Q4_1, Q4_K), so every product stays fp32", config.activation_quantization)
                return decoder
            if config.quantization != "auto":
                raise ConfigError(f"quantization={config.quantization!r} needs the CPU kernels: {reason}")
            if config.activation_quantization != "none":
                raise ConfigError(f"activation_quantization={config.activation_quantization!r} needs the CPU "
                                  f"kernels: {reason}")
            logger.warning("%s: running the plain-PyTorch model with expanded weights", reason)
        elif config.quantization not in ("auto", "none"):
            raise ConfigError(f"quantization={config.quantization!r} runs on the CPU kernels only "
                             f"(device {config.device}, dtype {config.dtype}); use 'auto' or 'none'")
        if config.activation_quantization != "none" and not wants_cpu_kernels(config):
            raise ConfigError(f"activation_quantization={config.activation_quantization!r} runs on the CPU "
                              f"kernels only (device {config.device}, dtype {config.dtype}, quantization "
                              f"{config.quantization})")
        dtype = resolve_dtype(config.dtype, self.device)
        model = load_model(config.model, dtype, self.device)
        if config.prepack_weights and prepack_supported(dtype, self.device):
            num_packed = model.prepack_weights()
            logger.info("prepacked %d linear weights for oneDNN (dense copies kept for 1-3 row steps)", num_packed)
        return model

    @property
    def context_cost(self) -> float:
        """A token's attention FLOPs per token of context before it (4 * layers * heads *
        head_dim: q.k and p.v), relative to its linear layers' (2 * their weights), for the
        scheduler's prompt budget."""
        cfg = self.model_config
        linear = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # qkv
        linear += cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        attention = 4 * cfg.num_heads * cfg.head_dim
        return attention / (2 * linear)

    def _kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the activations' ("auto"), or a 16- or 8-bit one (the CPU
        kernels widen each element to fp32 as they read it; the plain-PyTorch model widens the
        gathered blocks to its dtype)."""
        kv_dtype = kv_cache_torch_dtype(self.config.kv_cache_dtype, self.dtype)
        if kv_dtype != self.dtype:
            logger.info("KV cache in %s (opt-in: K and V rounded; see `backfill bench divergence`)", kv_dtype)
        return kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        element_size = self.kv_dtype.itemsize
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_size

    def _fit_max_model_len(self) -> int:
        """The context length the KV pool can hold. A sequence longer than the whole pool would
        wait forever, so the server must refuse it as too long (a 400), not take it. A length
        the pool cannot hold (a small `--num-kv-blocks`, or the default pool's byte cap on a
        long-context model) is lowered to what it holds, with a warning."""
        capacity = self.num_kv_blocks * self.block_size
        if self.max_model_len > capacity:
            logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more (%d blocks "
                           "of %d; --num-kv-blocks raises it)", self.max_model_len, capacity,
                           self.num_kv_blocks, self.block_size)
        return min(self.max_model_len, capacity)

    def _default_num_kv_blocks(self) -> int:
        return default_num_kv_blocks(self.config.max_num_seqs, self.max_model_len, self.block_size,
                                     self.kv_bytes_per_token)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        k_shape, v_shape = self.model.kv_cache_shapes(num_blocks, self.block_size)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size * self.kv_bytes_per_token / 2**20,
        )
        def zeros(shape: tuple[int, ...]) -> torch.Tensor:  # K or V, as the model lays them out
            if self.device.type == "cpu":  # on huge pages where it can: every step sweeps them
                return kernels.zeros(shape, self.kv_dtype)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

        return [(zeros(k_shape), zeros(v_shape)) for _ in range(cfg.num_layers)]

    def execute(self, scheduler_output: SchedulerOutput,
                grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, sample where `sample` is set
        (within `grammar_bitmask` for the constrained sequences)."""
        scheduled = scheduler_output.scheduled
        if (self.fast_decodes and isinstance(self.model, CpuDecoder) and scheduled
                and all(item.num_tokens == 1 and item.sample and item.new_request is None for item in scheduled)
                and not self.prompt_logprobs.rows(scheduled)):
            # (no inference_mode: entering it costs ~50 us of a step whose caches are cold)
            self._forget(scheduler_output.finished_request_ids)
            return self._execute_decodes(scheduler_output, grammar_bitmask)
        return self._execute(scheduler_output, grammar_bitmask)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.sampler.remove_request(request_id)
            self.prompt_logprobs.remove(request_id)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput,
                 grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        self._forget(scheduler_output.finished_request_ids)
        for item in scheduler_output.scheduled:
            if item.new_request is not None:
                new = item.new_request
                self.sampler.add_request(new.request_id, new.params, new.prompt_token_ids)
                if new.params.prompt_logprobs is not None:
                    self.prompt_logprobs.add(new.request_id, new.prompt_token_ids, new.params.prompt_logprobs)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[])

        prompt_rows = self.prompt_logprobs.rows(scheduler_output.scheduled)
        decode = (None if self.graph_runner is None or prompt_rows
                  else decode_inputs(scheduler_output, self.scratch_block, self.block_size))
        if decode is not None and self.graph_runner is not None and self.graph_runner.graph_key(decode) is not None:
            return self._execute_graphed(scheduler_output, decode, grammar_bitmask)
        batch = build_batch(scheduler_output, self.block_size, self.device, self.scratch_block,
                            self.model_config.sliding_window,
                            plan_torch_attention=not isinstance(self.model, CpuDecoder), prompt_rows=prompt_rows)
        prompt_logprobs = {}
        if not prompt_rows:
            logits = self.model.forward_logits(
                batch.input_ids, batch.positions, self.kv_caches, batch.metadata, batch.logits_index
            )  # [S_sample + P, vocab] float32
        else:  # the prompt rows' logits are taken a few hundred rows at a time
            hidden = self.model.forward_rows(batch.input_ids, batch.positions, self.kv_caches, batch.metadata,
                                             batch.logits_index)  # [S_sample + P + prompt rows, hidden]
            logits = self.model.compute_logits(hidden[:batch.prompt_logits_start])
            prompt_logprobs = self.prompt_logprobs.logprobs(scheduler_output.scheduled, prompt_rows,
                                                            hidden[batch.prompt_logits_start:], self.model.compute_logits)
        if not batch.sample_request_ids:  # only partial prompt chunks (and padding) this step
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        num_sample = len(batch.sample_request_ids)
        if logits.shape[0] > num_sample:
            logits = logits[:num_sample]  # padding rows dropped
        sampled = self.sampler.sample(batch.sample_request_ids, logits, grammar_bitmask)
        return ModelRunnerOutput(
            request_ids=batch.sample_request_ids,
            sampled_token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _execute_decodes(self, scheduler_output: SchedulerOutput,
                         grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        """A step of decodes only (one token a sequence, each sampling, none new; and a static
        batch's padding rows, as build_batch lays them out) on the CPU kernels, from plain lists
        (CpuDecoder.decode): no tensor is built for it, and plain greedy rows take their argmax
        in the same call."""
        assert isinstance(self.model, CpuDecoder)
        scheduled = scheduler_output.scheduled
        request_ids = [item.request_id for item in scheduled]
        token_ids = [item.token_ids[0] for item in scheduled]
        positions = [item.num_computed_tokens for item in scheduled]
        tables = [item.block_ids for item in scheduled]
        if scheduler_output.padding_seq_lens:
            padding_positions, padding_tables = padding_rows(scheduler_output.padding_seq_lens, self.scratch_block,
                                                             self.block_size)  # their token: 0
            token_ids += [0] * len(padding_positions)
            positions += padding_positions
            tables += padding_tables
        greedy = grammar_bitmask is None and self.sampler.plain_greedy(request_ids)
        logits, tokens = self.model.decode(token_ids, positions, tables, self.kv_caches,
                                           self.model_config.sliding_window, greedy)
        num_sample = len(scheduled)  # the padding rows' come last, dropped
        if not greedy:
            if logits.shape[0] > num_sample:
                logits = logits[:num_sample]
            sampled = self.sampler.sample(request_ids, logits, grammar_bitmask)
            return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=sampled.token_ids,
                                     logprobs=sampled.logprobs)
        return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=tokens[:num_sample])

    def _execute_graphed(self, scheduler_output: SchedulerOutput, decode: DecodeInputs,
                         grammar_bitmask: GrammarBitmask | None) -> ModelRunnerOutput:
        """A decode-only step through the captured graphs (padded rows already dropped)."""
        assert self.graph_runner is not None
        logits = self.graph_runner.run(decode)  # [n, vocab] float32
        if not decode.sample_rows:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[])
        if len(decode.sample_rows) < decode.num_seqs:
            logits = logits[decode.sample_rows]  # [S_sample, vocab]
        request_ids = [scheduler_output.scheduled[i].request_id for i in decode.sample_rows]
        sampled = self.sampler.sample(request_ids, logits, grammar_bitmask)
        return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=sampled.token_ids,
                                 logprobs=sampled.logprobs)
