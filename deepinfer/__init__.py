"""deepinfer: LLM inference serving. Offline API: `LLM`, `SamplingParams` (vLLM-compatible)."""

from deepinfer.engine.llm import LLM
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured import StructuredOutputParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
