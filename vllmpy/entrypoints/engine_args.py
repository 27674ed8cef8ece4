"""Engine flags shared by vllm-cli, vllm-server and vllm-bench; each binds to one EngineConfig field."""
from __future__ import annotations

import argparse
from dataclasses import fields

from vllmpy.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    MAMBA_SSM_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    TASKS,
    EngineConfig,
    engine_arg_names,
)
from vllmpy.distributed.config import EXECUTOR_BACKENDS
from vllmpy.spec_decode.config import SpeculativeConfig
from vllmpy.multimodal.media import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_BYTES
from vllmpy.structured_output.config import StructuredOutputsConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or org/repo[:QUANT] in the HF cache (default: embedded Gemma 3 270M Q4_K_M)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--revision", default=None, help="hub revision for --model org/repo")
    g.add_argument("--download-dir", default=None, help="hub cache directory (default: HF_HOME)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype; auto = float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} (or cuda:N)")
    g.add_argument("--task", default="auto", choices=TASKS,
                   help="generate text, embed or classify (pool hidden states); auto = the architecture's "
                        "own (BertModel, LlamaModel, Qwen3Model embed; *ForSequenceClassification classify; "
                        "*ForCausalLM generate)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for per position; -1 = the whole "
                        "vocabulary (a request asking for -1 is refused unless this is -1)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per layer (overrides sizing)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="byte budget for the whole KV pool")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="KV cache storage: auto = the checkpoint's declared kv_cache_quant_algo, else the model "
                        "dtype; fp8 (= fp8_e4m3) / fp8_e5m2: 1 byte per value over the checkpoint's "
                        "k_scale/v_scale (else 1.0); int8: 1 byte per value and an fp16 scale per 32")
    g.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                   help="storage of recurrent layers' SSM / delta-rule state (Mamba2, Gated DeltaNet); auto = "
                        "float32")
    g.add_argument("--recurrent-snapshot-fraction", type=float, default=0.1,
                   help="share of the KV pool that prefix-cache snapshots of recurrent layers' state may take "
                        "(one per 64 prompt tokens; Mamba2 / Gated DeltaNet / short-conv models)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    g.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='vLLM\'s structured-output defaults as JSON, e.g. \'{"disable_additional_properties": '
                        'true}\' (every JSON schema strict); keys: '
                        + ", ".join(f.name for f in fields(StructuredOutputsConfig)))
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT safetensors)")
    g.add_argument("--max-loras", type=int, default=1, help="most distinct LoRA adapters in one step")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help=f"highest adapter rank accepted; one of {', '.join(map(str, LORA_RANKS))}")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in memory (default: --max-loras)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding config, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "suffix"}\'; keys: '
                        + ", ".join(f.name for f in fields(SpeculativeConfig)))
    g.add_argument("--seed", type=int, default=None,
                   help="engine random seed (vllm-cli also uses it as the request's sampling seed)")
    add_image_args(parser)
    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over N worker processes (gloo on CPU, NCCL on CUDA)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into N stages, one per worker process, with up to N micro-batches in "
                        "flight (dense Llama-style decoders; not combined with --tensor-parallel-size yet)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="vllm-server: N engine processes (each a whole engine, -tp ranks apiece) behind one "
                        "server, requests to the least-loaded with prefix-cache affinity; offline: only 1")
    g.add_argument("--distributed-executor-backend", default=None, choices=EXECUTOR_BACKENDS,
                   help="mp: worker processes on this host (the default when -tp or -pp > 1); uni: one process; "
                        "ray: Ray actors on the cluster RAY_ADDRESS names (pip install 'vllmpy[ray]')")


def add_image_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("images")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='most images per prompt, e.g. \'{"image": 2}\' (default: no limit but the context)')
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="the one directory image_url file:// URLs may read (default: file:// is refused)")
    g.add_argument("--media-fetch-timeout", type=float, default=None,
                   help=f"seconds an http(s) image_url download may take (default {DEFAULT_FETCH_TIMEOUT})")
    g.add_argument("--max-media-bytes", type=int, default=None,
                   help=f"largest encoded image accepted, in bytes (default {DEFAULT_MAX_BYTES})")
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                   help="image tokens the vision encoder may produce in one step (default: "
                        "--max-num-batched-tokens)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = set(engine_arg_names())
    # An unset flag (None) keeps the config default; --seed also seeds the engine when given.
    return EngineConfig.from_kwargs(**{k: v for k, v in vars(args).items() if k in names and v is not None})
