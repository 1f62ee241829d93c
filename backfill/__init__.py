"""backfill: an LLM inference server built around continuous (iteration-level) batching."""

from backfill.config import EngineConfig
from backfill.outputs import CompletionOutput, RequestOutput
from backfill.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model; import it lazily so `import backfill` stays light.
    if name == "LLM":
        from backfill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
