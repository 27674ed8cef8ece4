"""Loading a quantized checkpoint never holds a dense copy: the peak RSS that its quantized layers add is at
most 1.3x their share of the file plus their share of the KV pool (16 blocks of 16 tokens). Measured in child processes as the
difference between a 1-layer and a 9-layer GPTQ int4 checkpoint of one shape (same tokenizer, embeddings
and interpreter), so the interpreter's own memory cancels; and from the first weight read through a short
generate for fp8 and AWQ int4 checkpoints with a bf16 embedding, and for a gpt-oss-shaped MXFP4 one whose
expert stacks are most of the file (a dense copy of one layer's experts would be 7.5x its share)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, GROUP = 1024, 4096, 128
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (256, HIDDEN), "self_attn.v_proj": (256, HIDDEN),
          "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
          "mlp.up_proj": (INTERMEDIATE, HIDDEN), "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
CHILD = """
import sys
from vllmpy import LLM
llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=16, block_size=16)
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024)
"""


def _write(out: Path, layers: int, tokenizer_dir: str) -> int:
    """A GPTQ int4 (group 128, asymmetric) Llama with random codes; returns the file size."""
    g = torch.Generator().manual_seed(layers)
    out.mkdir()
    tensors = {"model.embed_tokens.weight": torch.randn(256, HIDDEN, generator=g) * 0.02,
               "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        for module, (rows, cols) in SHAPES.items():
            groups = cols // GROUP
            tensors[f"{prefix}.{module}.qweight"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (cols // 8, rows),
                                                                  generator=g, dtype=torch.int32)
            tensors[f"{prefix}.{module}.qzeros"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (groups, rows // 8),
                                                                 generator=g, dtype=torch.int32)
            tensors[f"{prefix}.{module}.scales"] = (torch.rand(groups, rows, generator=g) * 1e-3).half()
            tensors[f"{prefix}.{module}.g_idx"] = (torch.arange(cols) // GROUP).to(torch.int32)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
              "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 256,
              "max_position_embeddings": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False,
                                      "desc_act": False}}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_bytes((Path(tokenizer_dir) / "tokenizer.json").read_bytes())
    return (out / "model.safetensors").stat().st_size


def _peak_rss(model_dir: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one malloc arena: other threads' arenas make the peak noisy
    result = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


def test_peak_rss_within_1_3x_of_the_quantized_file(smollm2_tokenizer_dir, tmp_path):
    small = _write(tmp_path / "one", 1, smollm2_tokenizer_dir)
    large = _write(tmp_path / "nine", 9, smollm2_tokenizer_dir)
    added_file = large - small  # 8 layers: ~63 MB of qweight / qzeros / scales
    added_rss = _peak_rss(tmp_path / "nine") - _peak_rss(tmp_path / "one")
    added_kv = 8 * 2 * 4 * (HIDDEN // 16) * 4 * 16 * 16  # layers x (k, v) x kv heads x head_dim x fp32 x tokens
    print(f"8 GPTQ int4 layers: file +{added_file / 2**20:.1f} MiB, peak RSS +{added_rss / 2**20:.1f} MiB")
    assert added_rss <= 1.3 * added_file + added_kv


# The bound as FEATURES.md states it for a whole checkpoint: peak RSS minus the RSS before any weight is
# read (interpreter, torch, tokenizer) <= 1.3x the file plus the KV pool, loading and then generating.
CHILD_FROM_FIRST_READ = """
import sys
from vllmpy.loader.quantization.weights import QuantizedSafetensors
read = QuantizedSafetensors.iterate
def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024
def iterate(self, *args, **kwargs):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the RSS now, before the first weight is read
    print("before", rss("VmRSS:"))
    yield from read(self, *args, **kwargs)
QuantizedSafetensors.iterate = iterate
from vllmpy import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_blocks=16, block_size=16)
llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
print("peak", rss("VmHWM:"))
"""


QUANT_CONFIGS = {"fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
                 "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}}


def _linear(quant: str, rows: int, cols: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear's tensors (names without the module prefix): fp8 per tensor, or AWQ int4 with random codes
    and zeros (group 128: Q4Z128 blocks)."""
    if quant == "fp8":
        codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(1e-3)}
    groups = cols // GROUP
    return {"qweight": torch.randint(-2 ** 31, 2 ** 31 - 1, (cols, rows // 8), generator=g, dtype=torch.int32),
            "qzeros": torch.randint(-2 ** 31, 2 ** 31 - 1, (groups, rows // 8), generator=g, dtype=torch.int32),
            "scales": (torch.rand(groups, rows, generator=g) * 1e-3).half()}


def _write_qwen2(out: Path, quant: str, layers: int, tokenizer_dir: str) -> int:
    """A Qwen2 (tied head) of `quant` linears with a bf16 embedding of the tokenizer's whole vocabulary, the
    dense table a large part of the file as in a 0.5B model; returns the file size."""
    from vllmpy.tokenizer import Tokenizer

    g = torch.Generator().manual_seed(layers)
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    out.mkdir()
    tensors = {"model.embed_tokens.weight": (torch.randn(vocab, HIDDEN, generator=g) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for module, (rows, cols) in SHAPES.items():
            tensors.update({f"{prefix}.{module}.{k}": v for k, v in _linear(quant, rows, cols, g).items()})
        for bias in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{prefix}.self_attn.{bias}.bias"] = torch.zeros(SHAPES[f"self_attn.{bias}"][0],
                                                                    dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
              "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": vocab,
              "max_position_embeddings": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
              "torch_dtype": "bfloat16", "quantization_config": QUANT_CONFIGS[quant]}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_bytes((Path(tokenizer_dir) / "tokenizer.json").read_bytes())
    return (out / "model.safetensors").stat().st_size


@pytest.mark.parametrize("quant,layers", [("fp8", 2), ("awq", 8)])
def test_peak_rss_from_the_first_read_within_1_3x_of_a_checkpoint_with_a_bf16_embedding(
        quant, layers, smollm2_tokenizer_dir, tmp_path):
    size = _write_qwen2(tmp_path / quant, quant, layers, smollm2_tokenizer_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD_FROM_FIRST_READ, str(tmp_path / quant)], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = dict(line.split() for line in result.stdout.splitlines() if line.startswith(("before", "peak")))
    added = int(figures["peak"]) - int(figures["before"])
    kv = layers * 2 * 4 * (HIDDEN // 16) * 4 * 16 * 16
    print(f"{quant} + bf16 embedding: file {size / 2**20:.1f} MiB, peak RSS from the first read +{added / 2**20:.1f} "
          f"MiB ({added / size:.2f}x)")
    assert added <= 1.3 * size + kv


# gpt-oss-shaped (32 experts top-4, untied bf16 tables as openai ships them): the MXFP4 expert stacks are
# most of the file, as in gpt-oss-20b (~12 of its 13 GB).
OSS_HIDDEN, OSS_INTER, OSS_EXPERTS, OSS_LAYERS, OSS_HEAD_DIM, OSS_KV_HEADS = 512, 1024, 32, 8, 64, 2


def _write_gpt_oss(out: Path, tokenizer_dir: str) -> tuple[int, int]:
    """A GptOssForCausalLM in openai's on-disk layout with random MXFP4 codes (scales near 2^-6) and bf16
    everything else; names and shapes from transformers' model built on the meta device. Returns the file
    size and the expert stacks' bytes."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.quant.test_mxfp4 import GPT_OSS_QUANT
    from vllmpy.tokenizer import Tokenizer

    config = GptOssConfig(vocab_size=Tokenizer.from_pretrained(tokenizer_dir).vocab_size, hidden_size=OSS_HIDDEN,
                          intermediate_size=OSS_INTER, num_hidden_layers=OSS_LAYERS, num_attention_heads=8,
                          num_key_value_heads=OSS_KV_HEADS, head_dim=OSS_HEAD_DIM, num_local_experts=OSS_EXPERTS,
                          num_experts_per_tok=4, max_position_embeddings=256, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 8})
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in GptOssForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors, expert_bytes = {}, 0
    for name, shape in shapes.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            experts, cols, rows = shape  # transformers' [E, in, out]; on disk [E, out, in / 32, 16] codes
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                                      dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(119, 123, (experts, rows, cols // 32), generator=g,
                                                      dtype=torch.uint8)
            expert_bytes += experts * rows * cols // 32 * 17
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["GptOssForCausalLM"],
                                                 "torch_dtype": "bfloat16", "quantization_config": GPT_OSS_QUANT}))
    (out / "tokenizer.json").write_bytes((Path(tokenizer_dir) / "tokenizer.json").read_bytes())
    return (out / "model.safetensors").stat().st_size, expert_bytes


def test_peak_rss_from_the_first_read_within_1_3x_of_a_gpt_oss_mxfp4_checkpoint(smollm2_tokenizer_dir, tmp_path):
    size, experts = _write_gpt_oss(tmp_path / "oss", smollm2_tokenizer_dir)
    assert experts > 0.65 * size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD_FROM_FIRST_READ, str(tmp_path / "oss")], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = dict(line.split() for line in result.stdout.splitlines() if line.startswith(("before", "peak")))
    added = int(figures["peak"]) - int(figures["before"])
    kv = OSS_LAYERS * 2 * OSS_KV_HEADS * OSS_HEAD_DIM * 4 * 16 * 16
    print(f"gpt-oss MXFP4: file {size / 2**20:.1f} MiB (experts {experts / 2**20:.1f}), peak RSS from the first "
          f"read +{added / 2**20:.1f} MiB ({added / size:.2f}x)")
    assert added <= 1.3 * size + kv
