"""vllmpy: vLLM's behaviour and API in a Python codebase you can read in an afternoon."""
from vllmpy.lora.request import LoRARequest
from vllmpy.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "ModelRegistry", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams",
           "EmbeddingRequestOutput", "EmbeddingOutput", "LoRARequest", "__version__"]


def __getattr__(name: str):
    # Importing LLM pulls in torch; keep `import vllmpy` light for tools that only need the types.
    if name == "LLM":
        from vllmpy.entrypoints.llm import LLM
        return LLM
    if name == "ModelRegistry":  # out-of-tree architectures (see vllmpy.plugins)
        from vllmpy.models.registry import ModelRegistry
        return ModelRegistry
    raise AttributeError(name)
