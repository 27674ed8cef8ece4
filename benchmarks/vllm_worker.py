"""Runs inside vLLM's CPU virtualenv for benchmarks/peers.py: loads the model once, then answers one JSON
request per stdin line ({"prompts": [[ids]], "max_tokens": n}) with a `PEER-RESULT {...}` line.

    <vllm-venv>/bin/python benchmarks/vllm_worker.py HF_DIR MAX_MODEL_LEN MAX_NUM_SEQS
"""
import json
import sys
import time

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def reply(payload: dict) -> None:
    print("PEER-RESULT " + json.dumps(payload), flush=True)


def main() -> None:
    model, max_model_len, max_num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=0)
    reply({"version": vllm.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        reply({"seconds": time.perf_counter() - start,
               "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})


if __name__ == "__main__":
    main()
