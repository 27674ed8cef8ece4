"""Runs inside a peer's own virtualenv for benchmarks/peers.py: loads the model once, then answers one JSON
request per stdin line ({"prompts": [[ids]], "max_tokens": n}) with a `PEER-RESULT {...}` line. Imports
nothing from vllmpy: the peer's virtualenv has only the peer.

    <venv>/bin/python benchmarks/peer_worker.py ENGINE SETTINGS   (SETTINGS: JSON of ENGINE's loader's arguments)
"""
import json
import os
import sys
import time
from collections.abc import Callable

# generate(prompts, max_tokens) -> output tokens; greedy, EOS ignored.
Generate = Callable[[list[list[int]], int], int]


def reply(payload: dict) -> None:
    print("PEER-RESULT " + json.dumps(payload), flush=True)


def load_vllm(model: str, max_model_len: int, max_num_seqs: int, kv_cache_bytes: int,
              dtype: str = "float32") -> tuple[str, Generate]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              kv_cache_memory_bytes=kv_cache_bytes, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return f"vllm {vllm.__version__}", generate


def load_llama_cpp(model: str, max_model_len: int, threads: int,
                   prompt_lookup: dict | None = None) -> tuple[str, Generate]:
    """llama-cpp-python's Python API decodes one sequence at a time, so the prompts run one after another.
    prompt_lookup: arguments of its LlamaPromptLookupDecoding (n-gram drafts from the context), else none.
    Drafting verifies from logits of every position, so it needs logits_all=True (a draft model alone turns
    on the all-positions decode but leaves the n_batch-row scores buffer, which the first long prompt
    overflows): n_ctx x vocabulary float32 scores, 1 GiB per 1,024 tokens of Gemma 3's 262k vocabulary, so
    peers.py fits max_model_len to the prompts."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(**prompt_lookup) if prompt_lookup else None
    llm = llama_cpp.Llama(model_path=model, n_ctx=max_model_len, n_threads=threads, n_threads_batch=threads,
                          draft_model=draft, logits_all=draft is not None, verbose=False)
    if draft is not None:  # fault the scores buffer in now: else the first long prompt's timing pays for it
        llm.scores.fill(0.0)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        produced = 0
        for prompt in prompts:
            llm.reset()  # no reuse of the previous prompt's KV cells
            # Llama.generate yields sampled tokens without an EOS check, so stopping at max_tokens ignores EOS.
            for count, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
                if count == max_tokens:
                    break
            produced += count
        return produced

    lookup = f" + LlamaPromptLookupDecoding({prompt_lookup})" if prompt_lookup else ""
    return f"llama-cpp-python {llama_cpp.__version__}{lookup}", generate


LOADERS = {"vllm": load_vllm, "llama.cpp": load_llama_cpp}


def main() -> None:
    # Python put this script's folder first on sys.path, where benchmarks/kernels.py would shadow the `kernels`
    # package transformers probes for (inside vLLM's import): the peer must see only its own virtualenv.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    version, generate = LOADERS[sys.argv[1]](**json.loads(sys.argv[2]))
    reply({"version": version})
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        produced = generate(request["prompts"], request["max_tokens"])
        reply({"seconds": time.perf_counter() - start, "output_tokens": produced})


if __name__ == "__main__":
    main()
