"""Quantized weight formats side by side on one 0.5B-class shape with random weights (Qwen2.5-0.5B: hidden 896,
24 layers, 14 heads / 2 KV heads, head_dim 64, intermediate 4864, q/k/v biases, tied embeddings; the vocabulary
trimmed to 32768 rows to keep the files small). Each format is written in its real on-disk layout by the gate's
own writers (tests/quant/reference.py for the safetensors formats, tests/gguf/test_gguf_loader.py for GGUF),
then measured in a fresh subprocess pinned to one CPU with one thread: file size, peak RSS (VmHWM) after load,
the peak RSS added from the first weight read (interpreter, torch and tokenizer excluded) through the timed runs,
256-token prefill tok/s (one prompt, max_tokens=1) and batch-1 decode tok/s (the time of a 1+N-token generate
minus that of a 1-token one, on distinct random prompts so no prefix is cached). Formats alternate within each
repetition (rotated order) and the table reports medians: the host is shared with other jobs, whose load is
printed. GGUF Q4_K_M follows llama.cpp's type choice (Q6_K for token_embd and for attn_v / ffn_down where
use_more_bits holds, Q4_K elsewhere) and its fallback for rows that are no multiple of 256 (Q6_K -> Q8_0,
Q4_K -> Q5_0), so at hidden 896 only ffn_down is a k-quant; gguf-py cannot quantize k-quants, so those blocks
are random valid Q4_K / Q6_K bytes (gguf-py quantizes Q8_0 / Q5_0).

    python benchmarks/quantized_formats.py [--reps 3] [--decode 16] [--prefill 256] [--cpu 0] [--dir DIR]
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
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.*: the formats' writers and the tokenizer
from benchmarks.machine import load_average
from tests.conftest import _hf_tokenizer_dir, smollm2_gguf
from tests.gguf.test_gguf_archs import _TOKENIZER_KEYS
from tests.gguf.test_gguf_loader import _encode, _hparams
from tests.gguf.test_gguf_loader import _write as write_gguf
from tests.quant import reference as ref
from tests.quant.checkpoints import _ct

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 896, 24, 14, 2, 64, 4864, 32768
LINEARS = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
           "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
           "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
REPO = str(Path(__file__).resolve().parent.parent)
KV_POOL = 64 * 16 * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # the child's 64 blocks of 16 tokens, float32 K and V
_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
# format -> quantization_config (None: bf16 safetensors; "gguf:<type>": a GGUF file)
CONFIGS: dict[str, dict | str | None] = {
    "bf16": None,
    "fp8 per-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8 block 128x128": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "GPTQ int4 g128 sym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "GPTQ int4 g128 asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False},
    "AWQ int4 g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "CT W4A16 g128": _ct("pack-quantized", _INT4),
    "CT W4A16 g128 asym": _ct("pack-quantized", {**_INT4, "symmetric": False}),
    "CT W8A16 channel": _ct("pack-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                                   "strategy": "channel"}),
    "GGUF Q8_0": "gguf:Q8_0",
    "GGUF Q4_K_M": "gguf:Q4_K_M",
}
CHILD = """
import json, random, sys, time
import torch
torch.set_num_threads(1)
import vllmpy.engine.core as core
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024
build, marks = core.build_model, {}
def build_model(*args, **kwargs):  # the RSS before any weight is read; VmHWM restarts from it
    marks["peak_before"], marks["before"] = status("VmHWM:"), status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return build(*args, **kwargs)
core.build_model = build_model
from vllmpy import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tokenizer=sys.argv[2], num_blocks=64, block_size=16, max_model_len=1024)
rss, loaded = max(marks["peak_before"], status("VmHWM:")), status("VmHWM:") - marks["before"]
decode, prefill = int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
def timed(length, tokens):
    prompt = {"prompt_token_ids": [rng.randrange(1000, 32000) for _ in range(length)]}
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    return time.perf_counter() - start
timed(16, 2)
first, full, long = timed(16, 1), timed(16, 1 + decode), timed(prefill, 1)
print(json.dumps({"rss": rss, "loaded": loaded, "added": status("VmHWM:") - marks["before"],
                  "decode": decode / (full - first), "prefill": prefill / long}))
"""


def _weights(seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The random model's float32 tensors (HF names), generated one at a time so no format holds them all."""
    g = torch.Generator().manual_seed(seed)
    yield "model.embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=g) * 0.02
    yield "model.norm.weight", torch.ones(HIDDEN)
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", torch.ones(HIDDEN)
        yield f"{prefix}.post_attention_layernorm.weight", torch.ones(HIDDEN)
        for module, (rows, cols) in LINEARS.items():
            yield f"{prefix}.{module}.weight", torch.randn(rows, cols, generator=g) * cols ** -0.5
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                yield f"{prefix}.{module}.bias", torch.randn(rows, generator=g) * 0.02


def _quantized(config: dict, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's tensors in `config`'s layout (names without the module prefix)."""
    method = config["quant_method"]
    if method == "fp8":
        block = "weight_block_size" in config
        codes, scale = ref.fp8_quantize(w, "block" if block else "tensor")
        return {"weight": codes, "weight_scale_inv" if block else "weight_scale": scale}
    if method == "compressed-tensors":
        scheme = config["config_groups"]["group_0"]["weights"]
        bits, group, sym = scheme["num_bits"], scheme.get("group_size", -1), scheme["symmetric"]
        return ref.ct_packed_tensors(*ref.quantize(w, bits, group, sym), bits, sym)
    q, zeros, scales = ref.quantize(w, config["bits"], config["group_size"], sym=config.get("sym", False))
    if method == "awq":
        return ref.awq_tensors(q, zeros, scales)
    return ref.gptq_tensors(q, zeros, scales, config["bits"], None, v1=True)


def _qwen2_config(quantization: dict | None) -> dict:
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    if quantization is not None:
        config["quantization_config"] = quantization
    return config


def write_safetensors(out: Path, quantization: dict | None) -> Path:
    """bf16 dense tensors, linears in the quantization's layout (fp16 scales as the writers make them)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in _weights():
        module = name.removesuffix(".weight")
        if quantization is not None and name.endswith(".weight") and module.endswith(tuple(LINEARS)):
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in _quantized(quantization, t).items()})
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_qwen2_config(quantization)))
    return out / "model.safetensors"


def _more_bits(layer: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for attn_v and ffn_down."""
    eighth = LAYERS // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def _gguf_type(kind: str, name: str, cols: int) -> gguf.GGMLQuantizationType:
    """llama.cpp's choice, with its fallback where a row is no multiple of 256 (k-quant blocks)."""
    Q = gguf.GGMLQuantizationType
    if name.endswith(("norm.weight", ".bias")):
        return Q.F32
    if kind == "Q8_0":
        return Q.Q8_0
    parts = name.split(".")
    more = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]))
    wanted = Q.Q6_K if name == "token_embd.weight" or more else Q.Q4_K
    return wanted if cols % 256 == 0 else {Q.Q6_K: Q.Q8_0, Q.Q4_K: Q.Q5_0}[wanted]


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *module, kind = hf.split(".")
    module = ".".join(module)
    local = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}.get(module, GGUF_NAMES.get(module))
    return f"blk.{layer}.{local}.{kind}"


def write_gguf_file(out: Path, kind: str) -> Path:
    rng = np.random.default_rng(0)
    tensors = {}
    for hf, t in _weights():
        name = _gguf_name(hf)
        qtype = _gguf_type(kind, name, t.shape[-1])
        values = np.ascontiguousarray(t.numpy())
        tensors[name] = (values if qtype == gguf.GGMLQuantizationType.F32 else _encode(values, qtype, rng), qtype)
    metadata = _hparams("qwen2", layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN)
    reader = gguf.GGUFReader(smollm2_gguf())  # SmolLM2's vocabulary, as the GGUF gate writes it
    metadata |= {"qwen2.rope.freq_base": 1000000.0, "qwen2.context_length": 32768,
                 **{key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}}
    out.mkdir(parents=True, exist_ok=True)
    return write_gguf(out / "model.gguf", "qwen2", metadata, tensors)


def write_format(name: str, root: Path) -> tuple[Path, int]:
    """The model path to load and the weight file's size."""
    config = CONFIGS[name]
    out = root / name.replace(" ", "_")
    gguf_kind = config.removeprefix("gguf:") if isinstance(config, str) else None
    path = out / ("model.gguf" if gguf_kind else "model.safetensors")
    if not path.exists():  # a kept --dir is reused
        write_gguf_file(out, gguf_kind) if gguf_kind else write_safetensors(out, config)
    return path if gguf_kind else out, path.stat().st_size


def measure(model: Path, tokenizer: str, cpu: int, decode: int, prefill: int,
            tree: str | None = None) -> dict[str, float]:
    """One fresh child's figures; `tree`: a directory whose vllmpy/ the child imports instead (--against)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", CHILD, str(model), tokenizer,
                             str(decode), str(prefill)], capture_output=True, text=True, timeout=900, env=env,
                            cwd=tree or REPO)  # `-c` puts the working directory first on sys.path
    if result.returncode != 0:
        raise RuntimeError(f"{model}: {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _rotated(names: list[str], rep: int) -> list[str]:
    shift = rep % len(names)
    return names[shift:] + names[:shift]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode", type=int, default=16, help="decode tokens timed per run")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill run")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU each measurement is pinned to")
    parser.add_argument("--formats", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dir", default=None, help="keep the checkpoints here and reuse them (default: a temp dir)")
    parser.add_argument("--against", default=None, help="a source tree (e.g. `git archive REV vllmpy` unpacked) "
                        "measured in the same rotation, each format right after this tree's run: an A/B table")
    args = parser.parse_args()
    trees = {"": None} | ({" (against)": args.against} if args.against else {})
    with contextlib.nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = _hf_tokenizer_dir(smollm2_gguf(), root / "tokenizer")
        written = {name: write_format(name, root) for name in args.formats}
        runs: dict[str, list[dict[str, float]]] = {name + tag: [] for name in args.formats for tag in trees}
        loads = [load_average()]
        for rep in range(args.reps):
            for name in _rotated(args.formats, rep):
                for tag, tree in trees.items():
                    runs[name + tag].append(measure(written[name][0], tokenizer, args.cpu, args.decode, args.prefill,
                                                    tree))
                    print(f"rep {rep} {name}{tag}: {runs[name + tag][-1]}", file=sys.stderr)
            loads.append(load_average())
    median: Callable[[str, str], float] = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
    print(f"{args.reps} reps, 1 thread pinned to CPU {args.cpu}, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"KV pool {KV_POOL / 2**20:.0f} MiB; added: the peak RSS over the RSS before the first weight read, "
          f"at the end of the load / of the timed runs")
    print("| format | file MiB | peak RSS MiB | RSS / file | added at load / file | added through the runs / file | "
          "(added through the runs - KV) / file | decode tok/s | prefill 256 tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tag in ((name, tag) for name in args.formats for tag in trees):
        size, rss = written[name][1] / 2**20, median(name + tag, "rss") / 2**20
        loaded, added = median(name + tag, "loaded") / 2**20, median(name + tag, "added") / 2**20
        print(f"| {name}{tag} | {size:.0f} | {rss:.0f} | {rss / size:.2f} | {loaded / size:.2f} | {added / size:.2f} | "
              f"{(added - KV_POOL / 2**20) / size:.2f} | {median(name + tag, 'decode'):.1f} | "
              f"{median(name + tag, 'prefill'):.1f} |")
    for name in args.formats if args.against else []:  # per-repetition ratios: this tree's over --against's
        for key in ("decode", "prefill"):
            ratios = sorted(a[key] / b[key] for a, b in zip(runs[name], runs[name + " (against)"]))
            print(f"{name} {key}: {statistics.median(ratios):.2f}x the --against tree's "
                  f"(per repetition {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
