"""deepinfer: LLM inference serving. Offline API: `LLM`, `SamplingParams` (vLLM-compatible)."""

from deepinfer import openmp_env

openmp_env.apply()  # before the imports below load torch and its OpenMP runtime

from deepinfer.engine.llm import LLM  # noqa: E402
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402
from deepinfer.engine.structured import StructuredOutputParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
