"""Engine configuration: flat dataclasses whose fields the CLI flags bind to one-to-one."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllmpy.distributed.config import ParallelConfig
from vllmpy.multimodal.config import check_media_settings, parse_mm_limits
from vllmpy.multimodal.media import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_BYTES
from vllmpy.spec_decode.config import SpeculativeConfig
from vllmpy.structured_output.config import StructuredOutputsConfig

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# vLLM's cache dtype names plus int8 (attention/kv_dtype.py maps them to storage dtypes).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# vLLM names we do not store, and why.
KV_CACHE_DTYPES_NOT_STORED = {"fp8_inc": "vLLM's Intel Gaudi fp8 format",
                              "fp8_ds_mla": "vLLM's DeepSeek MLA fp8 layout"}
# vLLM's --mamba-ssm-cache-dtype: the SSM / delta-rule state's storage; auto = float32 (the state
# accumulates every token, so it is kept wide unless asked; the conv window stays in the model dtype).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: the architecture's own (BertModel, LlamaModel, ... embed; *ForSequenceClassification classify)
TASKS = ("auto", "generate", "embed", "classify")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a value that is not a cache dtype we store, naming it."""
    if name in KV_CACHE_DTYPES_NOT_STORED:
        raise ValueError(f"--kv-cache-dtype {name} ({KV_CACHE_DTYPES_NOT_STORED[name]}) is not stored here; "
                         f"choose one of {', '.join(KV_CACHE_DTYPES)}")
    _require(name in KV_CACHE_DTYPES, f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


@dataclass
class ModelConfig:
    model: str | None = None  # None = the embedded default model
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None = the checkpoint's context length
    seed: int = 0
    logits_processors: list = field(default_factory=list)  # engine-level (batch) processors, objects or classes
    task: str = "auto"
    # Most logprobs a request may ask for per position (logprobs, prompt_logprobs; -1 = the whole vocabulary).
    # vLLM's default of 20: one request asking for the whole vocabulary at every position costs
    # vocab_size entries per token (megabytes of JSON), so that takes the operator's --max-logprobs -1.
    max_logprobs: int = 20
    # vLLM's StructuredOutputsConfig, or its dict / JSON text (--structured-outputs-config); validate() parses it
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None
    # vLLM's --speculative-config (a SpeculativeConfig, its dict or JSON text); validate() parses it; None = off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Images (vLLM's names): most per prompt ('{"image": N}' JSON or a dict; None = no limit), the one
    # directory file:// URLs may read (None = none), and http(s) fetches' timeout (s) and size cap (bytes).
    limit_mm_per_prompt: dict | str | None = None
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_media_bytes: int = DEFAULT_MAX_BYTES

    def validate(self) -> None:
        self.structured_outputs_config = StructuredOutputsConfig.parse(self.structured_outputs_config)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        check_media_settings(self.media_fetch_timeout, self.max_media_bytes)
        _require(self.task in TASKS, f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        _require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.device in DEVICES or self.device.startswith("cuda:"),
                 f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"--max-model-len must be >= 1, got {self.max_model_len}")
        _require(self.max_logprobs >= -1,
                 f"--max-logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # per-layer block count; overrides sizing
    kv_cache_memory: int | None = None  # bytes for the whole pool
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto: the checkpoint's declared KV quantization, else the model dtype
    mamba_ssm_cache_dtype: str = "auto"  # recurrent layers' SSM state; auto = float32
    # Share of the KV pool's bytes that prefix-cache snapshots of recurrent state may take (with caching on)
    recurrent_snapshot_fraction: float = 0.1

    def validate(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        _require(self.mamba_ssm_cache_dtype in MAMBA_SSM_CACHE_DTYPES,
                 f"--mamba-ssm-cache-dtype must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}, "
                 f"got {self.mamba_ssm_cache_dtype!r}")
        _require(0.0 <= self.recurrent_snapshot_fraction < 1.0,
                 f"--recurrent-snapshot-fraction must be in [0, 1), got {self.recurrent_snapshot_fraction}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"--block-size must be a power of two >= 1, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 1,
                 f"--num-blocks must be >= 1, got {self.num_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory >= 1,
                 f"--kv-cache-memory must be a positive byte count, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Image tokens the vision encoder may produce in one step (vLLM's); None = max_num_batched_tokens.
    max_num_encoder_input_tokens: int | None = None

    def validate(self) -> None:
        _require(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_encoder_input_tokens is None or self.max_num_encoder_input_tokens >= 1,
                 f"--max-num-encoder-input-tokens must be >= 1, got {self.max_num_encoder_input_tokens}")
        _require(self.max_num_batched_tokens >= 1,
                 f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                 f"got {self.scheduling_policy!r}")


# vLLM's accepted --max-lora-rank values (its punica kernels are built for these).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (resident slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in memory; None = max_loras

    def validate(self) -> None:
        _require(self.max_loras >= 1, f"--max-loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank in LORA_RANKS,
                 f"--max-lora-rank must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _require(self.max_cpu_loras >= self.max_loras,
                 f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat engine args (LLM(**kwargs), CLI flags); unknown names are refused."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig,
                 "parallel": ParallelConfig}
        values: dict[str, dict] = {name: {} for name in parts}
        owner = {f.name: name for name, kind in parts.items() for f in fields(kind)}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown engine argument {key!r}; known: {', '.join(sorted(owner))}")
            values[owner[key]][key] = value
        config = cls(**{name: kind(**values[name]) for name, kind in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.lora.validate()
        self.parallel.validate()
        _require(not (self.lora.enable_lora and self.parallel.tensor_parallel_size > 1),
                 f"--enable-lora with --tensor-parallel-size {self.parallel.tensor_parallel_size} is not supported: "
                 f"adapter deltas are not sharded across ranks; serve LoRA with --tensor-parallel-size 1")


def engine_arg_names() -> list[str]:
    return [f.name for kind in (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig, ParallelConfig)
            for f in fields(kind)]
