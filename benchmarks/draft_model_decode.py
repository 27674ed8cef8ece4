"""draft_model speculation on random Llamas (SmolLM2's 49k tokenizer, tied embeddings): batch-1 greedy decode tok/s
and acceptance, spec-off vs a draft, same tokens asserted. Three drafts of an 8-layer hidden-512 target: the
target itself (always agrees, costs as much), a 2-layer hidden-64 random model (never agrees: the adaptive
back-off pauses it), and -- against a "near" target whose layers 2..7 barely touch the residual stream
(o_proj / down_proj x 1e-3) -- that target's first 2 layers (mostly agrees, cheaper). Indicative only: random
weights, and a tiny draft still pays the whole vocabulary head per token.

tok/s = tokens / the generate call's time (prefill included), median of --rounds runs interleaved across configs.

    python benchmarks/draft_model_decode.py [--tokens 48] [--k 4] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.*: the tiny checkpoints and tokenizer
from tests.conftest import _hf_tokenizer_dir, smollm2_gguf
from tests.tiny_models import make_tiny_checkpoint
from vllmpy import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _llama(hidden: int, layers: int, ffn: int):
    from transformers import LlamaConfig

    return lambda vocab: LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                     num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                     max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                     tie_word_embeddings=True)


def _rewrite(src: Path, out: Path, layers: int | None = None, quiet_from: int | None = None) -> Path:
    """A copy of a checkpoint keeping its first `layers` layers, or with layers >= quiet_from scaled down."""
    shutil.copytree(src, out)
    state = load_file(src / "model.safetensors")
    index = lambda key: int(key.split(".")[2]) if key.startswith("model.layers.") else -1  # noqa: E731
    if layers is not None:
        state = {k: v for k, v in state.items() if index(k) < layers}
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    if quiet_from is not None:
        state = {k: v * 1e-3 if index(k) >= quiet_from and k.endswith(("o_proj.weight", "down_proj.weight")) else v
                 for k, v in state.items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="draft_bench_"))
    tokenizer = _hf_tokenizer_dir(smollm2_gguf(), root / "tokenizer")
    target, small = root / "target", root / "small"
    make_tiny_checkpoint("LlamaForCausalLM", tokenizer, target, make_config=_llama(512, 8, 1536))
    make_tiny_checkpoint("LlamaForCausalLM", tokenizer, small, make_config=_llama(64, 2, 128))
    near = _rewrite(target, root / "near", quiet_from=2)
    cases = {"target, spec-off": (target, None), "target, draft = itself": (target, target),
             "target, draft = 2-layer hidden-64": (target, small), "near, spec-off": (near, None),
             "near, draft = its first 2 layers": (near, _rewrite(near, root / "near_first2", layers=2))}
    llms = {name: LLM(model=str(model), dtype="float32", max_model_len=512, num_blocks=256, speculative_config=None
                      if draft is None else {"method": "draft_model", "model": str(draft),
                                             "num_speculative_tokens": args.k})
            for name, (model, draft) in cases.items()}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    tokens: dict[Path, list[int]] = {}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            start = time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
            times[name].append(time.perf_counter() - start)
            assert tokens.setdefault(cases[name][0], out) == out, f"{name}: not spec-off's tokens"
    for name, llm in llms.items():
        drafter = llm.engine.core.scheduler.drafter
        stats = "" if drafter is None else (f"; acceptance {drafter.stats.acceptance_rate or 0:.2f}, mean "
                                            f"acceptance length {drafter.stats.mean_acceptance_length or 1:.2f}")
        print(f"{name}: {args.tokens / statistics.median(times[name]):.1f} tok/s{stats}", flush=True)
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
