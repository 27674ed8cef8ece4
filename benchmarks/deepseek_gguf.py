"""vllmpy vs llama.cpp on one tiny-but-wide DeepSeek-V3-shaped GGUF (random weights): decode tok/s at batch 1
and 16, peak RSS with the expert stacks packed vs dequantized, and KV bytes per token (MLA latent vs expanded).

The shape keeps V3's proportions and every V3 mechanism at hidden 1024: 4 layers (layer 0 dense,
first_k_dense_replace 1), MLA with q_lora_rank 384, kv_lora_rank 512, rope 64 / nope 128 / v 128 over 16 heads,
64 routed experts top-6 in 8 groups of which 4 are kept (sigmoid scores, e_score_correction_bias,
norm_topk_prob, x2.5), one shared expert, expert width 384, YaRN x40 with mscale; SmolLM2's 49k vocabulary.
The file is written by the GGUF gate's deepseek2 writer (tests/gguf/test_gguf_deepseek2.py: MLA as MQA with
*_mla lengths, k_b / v_b split, stacked experts), every matrix quantized to --type (gguf-py writes Q8_0 and
Q4_0, not the k-quants), norms and the router bias F32.

Decode tok/s = batch x (N_long - N_short) / (t(N_long) - t(N_short)) over distinct random 16-token prompts
(prefill and per-call overhead cancel). vllmpy runs in this process (LLM.generate, max_num_seqs 16);
llama.cpp is its llama-server (one slot per sequence, continuous batching; llama-cpp-python decodes one
sequence at a time), its /completion driven by one thread per sequence. Both get --threads (1 by default: at 2
each on the shared 2-core dev host, load 14, both stalled in their spin-waiting thread pools and no round
finished in 15 minutes; use 2 on a quiet machine); they take turns
(A, B, A, B per round, never at once) and the table gives medians with the per-round ratio's range, since
the host is shared (its load average is printed). Peak RSS (VmHWM) of vllmpy comes from fresh child processes
that load the file and decode 16 tokens, packed and with VLLMPY_GGUF_KEEP_QUANT=0 (dequantized at load);
llama-server's after all rounds.

    python benchmarks/deepseek_gguf.py [--threads 1] [--rounds 5] [--type Q8_0] [--dir DIR] [--engines vllmpy]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.*: the gate's deepseek2 writer, the vocab
sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_servers
import peer_servers  # noqa: E402

from benchmarks.machine import load_average  # noqa: E402
from tests.conftest import smollm2_gguf  # noqa: E402
from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS, add_vocab, write_tensors  # noqa: E402
from tests.gguf.test_gguf_deepseek2 import _metadata, _tensors  # noqa: E402

LAYERS, HIDDEN, HEADS, DENSE_FFN = 4, 1024, 16, 2560
Q_LORA, KV_LORA, ROPE, NOPE, V = 384, 512, 64, 128, 128
EXPERTS, TOP_K, GROUPS, TOP_GROUPS, EXPERT_FFN = 64, 6, 8, 4, 384
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
PROMPT, SHORT, LONG, MAX_LEN, BATCHES = 16, 8, 40, 128, (1, 16)
LLAMA_SERVER = "/work/peers/llamacpp/bin/llama-server"

CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[2]))
from vllmpy import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=128, max_num_seqs=16)
llm.generate([{"prompt_token_ids": list(range(100, 116))}], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
             use_tqdm=False)
status = open("/proc/self/status").read()
print(json.dumps({"rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}))
"""


def _config(vocab_size: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=DENSE_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=163840, rms_norm_eps=1e-6,
        q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=GROUPS, topk_group=TOP_GROUPS,
        moe_intermediate_size=EXPERT_FFN, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters=YARN, rope_interleave=True, tie_word_embeddings=False)


def _state(vocab_size: int) -> dict[str, torch.Tensor]:
    """Random weights under HF's names, the experts already stacked [E, out, in] as the converter merges them."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab_size, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (vocab_size, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_a_proj.weight": (Q_LORA, HIDDEN), p + "self_attn.q_a_layernorm.weight": (Q_LORA,),
                   p + "self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
                   p + "self_attn.kv_a_layernorm.weight": (KV_LORA,),
                   p + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + V), KV_LORA),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * V)}
        if layer == 0:
            shapes |= {p + "mlp.gate_proj.weight": (DENSE_FFN, HIDDEN), p + "mlp.up_proj.weight": (DENSE_FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, DENSE_FFN)}
            continue
        shapes |= {p + "mlp.gate.weight": (EXPERTS, HIDDEN), p + "mlp.gate.e_score_correction_bias": (EXPERTS,),
                   p + "mlp.experts.gate_proj.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                   p + "mlp.experts.up_proj.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                   p + "mlp.experts.down_proj.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
                   **{p + f"mlp.shared_experts.{proj}.weight": shape for proj, shape in
                      (("gate_proj", (EXPERT_FFN, HIDDEN)), ("up_proj", (EXPERT_FFN, HIDDEN)),
                       ("down_proj", (HIDDEN, EXPERT_FFN)))}}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        else:  # unit-variance outputs from unit-variance inputs
            state[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    return state


def write_file(path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    reader = gguf.GGUFReader(smollm2_gguf())  # SmolLM2's vocabulary, as the GGUF gate writes it
    vocab = {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}
    config = _config(len(vocab["tokenizer.ggml.tokens"]))
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    _metadata(w, config, split=True)
    add_vocab(w, vocab)
    tensors = _tensors(_state(config.vocab_size), config, split=True)
    write_tensors(w, tensors, lambda name, data: qtype if data.ndim >= 2 and data.shape[-1] % 32 == 0 else None)
    return path


def _decode_rate(timed, batch: int) -> float:
    """tok/s of the decode steps alone: the difference of a long and a short generation of `batch` sequences."""
    short, long = timed(batch, SHORT), timed(batch, LONG)
    return batch * (LONG - SHORT) / (long - short)


class Ours:
    def __init__(self, path: Path) -> None:
        from vllmpy import LLM, SamplingParams

        self.llm, self.params = LLM(model=str(path), max_model_len=MAX_LEN, max_num_seqs=16), SamplingParams
        self.rng = np.random.default_rng(1)

    def timed(self, batch: int, tokens: int) -> float:
        prompts = [{"prompt_token_ids": self.rng.integers(100, 40000, PROMPT).tolist()} for _ in range(batch)]
        params = self.params(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
        return time.perf_counter() - start


class LlamaCpp:
    def __init__(self, path: Path, threads: int) -> None:
        self.server = peer_servers.llama_cpp_server(LLAMA_SERVER, str(path), MAX_LEN, max(BATCHES), threads)
        self.rng = np.random.default_rng(1)
        self.pool = ThreadPoolExecutor(max(BATCHES))

    def _one(self, prompt: list[int], tokens: int) -> int:
        reply = httpx.post(f"{self.server.base_url}/completion", timeout=3600, json={
            "prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False})
        reply.raise_for_status()
        return reply.json()["timings"]["predicted_n"]

    def timed(self, batch: int, tokens: int) -> float:
        prompts = [self.rng.integers(100, 40000, PROMPT).tolist() for _ in range(batch)]
        start = time.perf_counter()
        produced = list(self.pool.map(lambda p: self._one(p, tokens), prompts))
        assert produced == [tokens] * batch, produced
        return time.perf_counter() - start

    def rss(self) -> int:
        status = Path(f"/proc/{self.server.proc.pid}/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024

    def close(self) -> None:
        self.pool.shutdown()
        self.server.stop()


def child_rss(path: Path, threads: int, packed: bool) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLMPY_GGUF_KEEP_QUANT": "1" if packed else "0"}
    result = subprocess.run([sys.executable, "-c", CHILD, str(path), str(threads)], capture_output=True, text=True,
                            timeout=1200, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["rss"]


def kv_bytes() -> str:
    """Per token and layer: the latent vs K + V expanded per head, 16-bit elements (llama.cpp's f16 cache holds
    the latent as its K, 576 wide, and no V; vllmpy's holds it in the model dtype: fp32 here unless
    --kv-cache-dtype bfloat16)."""
    latent, expanded = (KV_LORA + ROPE) * 2, HEADS * (NOPE + ROPE + V) * 2
    return (f"KV bytes/token/layer, 16-bit: MLA latent {latent} vs expanded K+V {expanded} "
            f"({expanded / latent:.1f}x); vllmpy fp32 latent {2 * latent}; x {LAYERS} layers: {latent * LAYERS} vs "
            f"{expanded * LAYERS}")


def _table(rates: dict[tuple[str, int], list[float]], peer: bool) -> None:
    """Medians per batch: vllmpy's, and with llama.cpp its and the per-round ratio's median and range."""
    print("| batch | vllmpy tok/s | llama.cpp tok/s | ratio (median, range over rounds) |" if peer else
          "| batch | vllmpy tok/s (median, range over rounds) |")
    print("|---|---|---|---|" if peer else "|---|---|")
    for batch in BATCHES:
        mine = rates[("vllmpy", batch)]
        if not peer:
            print(f"| {batch} | {statistics.median(mine):.1f} ({min(mine):.1f}-{max(mine):.1f}) |")
            continue
        theirs = rates[("llama.cpp", batch)]
        ratios = [a / b for a, b in zip(mine, theirs)]
        print(f"| {batch} | {statistics.median(mine):.1f} | {statistics.median(theirs):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0"])
    parser.add_argument("--dir", default=None, help="keep the file here and reuse it (default: a temp dir)")
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--engines", default="vllmpy,llama.cpp", help="comma-separated: vllmpy, llama.cpp")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    with contextlib.nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"deepseek-v3-tiny-wide-{args.type}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, gguf.GGMLQuantizationType[args.type])
        size = path.stat().st_size
        rss = {} if args.skip_rss else {"packed": child_rss(path, args.threads, True),
                                        "dequantized": child_rss(path, args.threads, False)}
        ours = Ours(path)
        theirs = LlamaCpp(path, args.threads) if "llama.cpp" in args.engines.split(",") else None
        engines = {"vllmpy": ours.timed, **({"llama.cpp": theirs.timed} if theirs else {})}
        rates: dict[tuple[str, int], list[float]] = {(e, b): [] for e in engines for b in BATCHES}
        loads = [load_average()]
        try:
            for r in range(args.rounds):
                for batch in BATCHES:
                    for engine, timed in engines.items():
                        rates[(engine, batch)].append(_decode_rate(timed, batch))
                loads.append(load_average())
                print(f"round {r}: " + ", ".join(f"{e} b{b} {v[-1]:.1f}" for (e, b), v in rates.items()),
                      file=sys.stderr)
            llama_rss = theirs.rss() if theirs else None
        finally:
            if theirs:
                theirs.close()
    print(f"{path.name}: {size / 2**20:.0f} MiB, {args.threads} thread(s) each, {args.rounds} rounds, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    _table(rates, theirs is not None)
    if rss:
        peer_rss = f"; llama-server {llama_rss / 2**20:.0f} MiB ({max(BATCHES)} slots x {MAX_LEN} context)" \
            if llama_rss else ""
        print(f"peak RSS: vllmpy packed {rss['packed'] / 2**20:.0f} MiB, dequantized at load "
              f"{rss['dequantized'] / 2**20:.0f} MiB{peer_rss}; file {size / 2**20:.0f} MiB")
    print(kv_bytes())


if __name__ == "__main__":
    main()
