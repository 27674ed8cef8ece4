"""`mtp` speculation on a GGUF target: the MTP (nextn) block llama.cpp's converter appends after the decoder
(`blk.{n_layer}.*`, counted in block_count, `{arch}.nextn_predict_layers` = 1) drafts for `deepseek2`
(GLM-4.7-Flash's converter keeps the block; DeepSeek-V3's, the same layout, drops it) and `glm4moe`.

Each file is the safetensors MTP checkpoint of tests/models/test_spec_mtp.py converted as the converter does
(its decoder layer under the layer names, its own tensors as `nextn.eh_proj` / `nextn.enorm` / `nextn.hnorm`
/ `nextn.embed_tokens` / `nextn.shared_head_head` / `nextn.shared_head_norm`, gguf-py's constants), float32:
greedy spec-on gives spec-off's tokens, and every proposal equals the safetensors run's on the same weights.
A Q8_0 file keeps the block's experts packed and still gives spec-off's tokens.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.gguf.test_gguf_archs import _one_thread, _stack_experts, add_vocab, vocab, write_tensors  # noqa: F401 (fixtures)
from tests.gguf.test_gguf_deepseek2 import YARN
from tests.gguf.test_gguf_deepseek2 import _metadata as deepseek2_metadata
from tests.gguf.test_gguf_deepseek2 import _tensors as deepseek2_tensors
from tests.gguf.test_gguf_new_families import _converter_state
from tests.gguf.test_gguf_new_families import _metadata as families_metadata
from tests.models.test_mla_models import _mla, _moe
from tests.models.test_moe_families import glm4_moe
from tests.models.test_spec_decode import PROMPTS, _spec_off
from tests.models.test_spec_mtp import _assert_same, _mtp_llm, _outputs, _record_proposals, make_mtp_checkpoint

# The MTP block's own HF leaves -> gguf-py's tensor kinds (gguf 0.19 lists them for glm4moe, not deepseek2).
NEXTN = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
         "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "embed_tokens": gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS,
         "shared_head.head": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
         "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}
_OWN = re.compile(rf"model\.layers\.(\d+)\.({'|'.join(re.escape(leaf) for leaf in NEXTN)})\.weight")


def deepseek_v3(vocab_size: int):
    """tests/models' tiny V3 with the YaRN a GGUF can state (mscale == mscale_all_dim, one log multiplier)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_mla(vocab_size), **_moe(), q_lora_rank=24, n_group=4, topk_group=2,
                            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN, rope_interleave=True)


def _nextn_tensors(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Pops the block's own tensors out of `state`, under their GGUF names."""
    out = {}
    for name in [n for n in state if _OWN.fullmatch(n)]:
        match = _OWN.fullmatch(name)
        out[gguf.TENSOR_NAMES[NEXTN[match[2]]].format(bid=match[1]) + ".weight"] = state.pop(name).float().numpy()
    return out


def _convert(arch: str, hf_dir: Path, vocab: dict, path: Path, experts: gguf.GGMLQuantizationType | None) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    state = load_file(hf_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(path), arch)
    nextn = _nextn_tensors(state)
    if arch == "deepseek2":
        whole = copy.deepcopy(config)
        whole.num_hidden_layers += 1  # the converter counts the MTP block in block_count (GLM-4.7-Flash's)
        deepseek2_metadata(w, whole, split=True)
        w.add_nextn_predict_layers(1)
        tensors = deepseek2_tensors(state, whole, split=True)
    else:
        blocks = families_metadata(arch, w, config.to_dict())
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, blocks)
        tensors = {}
        _stack_experts(state)
        for hf, tensor in _converter_state(state, False, arch).items():
            mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert mapped is not None, f"gguf-py has no llama.cpp name for {hf}"
            tensors[mapped] = np.ascontiguousarray(tensor.float().numpy())
    add_vocab(w, vocab)
    write_tensors(w, {**tensors, **nextn},  # Q8_0 blocks need rows of 32s: DeepSeek's 24-wide down stacks stay F32
                  lambda name, data: experts if name.endswith("_exps.weight") and data.shape[-1] % 32 == 0 else None)
    return path


@pytest.fixture(scope="module", params=["deepseek2", "glm4moe"])
def converted(request, vocab, smollm2_tokenizer_dir, tmp_path_factory):
    """(arch, safetensors MTP checkpoint dir, its float32 GGUF)."""
    arch = request.param
    out = tmp_path_factory.mktemp(f"gguf_mtp_{arch}")
    if arch == "deepseek2":  # its own embedding and head (DeepSeek-V3's layout)
        make_mtp_checkpoint("DeepseekV3ForCausalLM", deepseek_v3, smollm2_tokenizer_dir, out / "hf", own=True)
    else:  # GLM-4.5's: the target's embedding and head
        make_mtp_checkpoint("Glm4MoeForCausalLM", glm4_moe, smollm2_tokenizer_dir, out / "hf", own=False)
    return arch, out / "hf", _convert(arch, out / "hf", vocab, out / f"{arch}.gguf", None)


def _run(llm) -> tuple[list, list, list]:
    """(spec-off outputs, spec-on outputs, every proposal of the spec-on run)."""
    proposals = _record_proposals(llm)
    reference = _spec_off(llm, lambda: _outputs(llm, PROMPTS))
    return reference, _outputs(llm, PROMPTS), proposals


def test_gguf_mtp_drafts_as_the_safetensors_block(converted):
    arch, hf_dir, path = converted
    ours = _mtp_llm(str(path), num_blocks=128)
    config = ours.engine.core.checkpoint.config
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3 if arch == "deepseek2" else 4, 1)
    draft = ours.engine.core.scheduler.drafter.proposer.runner.model
    assert (draft.embed_tokens is not None) == (arch == "deepseek2") == hasattr(draft.shared_head, "head")
    reference, spec_on, proposals = _run(ours)
    _assert_same(reference, spec_on, f"gguf {arch} mtp")
    _, st_spec_on, st_proposals = _run(_mtp_llm(str(hf_dir), num_blocks=128))
    assert [tokens for tokens, _ in spec_on] == [tokens for tokens, _ in st_spec_on]
    assert sum(len(d) for _, d in proposals) > 0, "nothing was drafted"
    assert proposals == st_proposals, f"gguf {arch}: the MTP block's proposals differ from the safetensors run's"


def test_gguf_mtp_block_stays_packed(converted, vocab, tmp_path):
    """Q8_0 expert stacks: the MTP block's experts compute on the file's blocks; spec-on == spec-off."""
    from vllmpy.layers.moe import ExpertLinear

    arch, hf_dir, _ = converted
    path = _convert(arch, hf_dir, vocab, tmp_path / f"{arch}-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    llm = _mtp_llm(str(path), num_blocks=128)
    draft = llm.engine.core.scheduler.drafter.proposer.runner.model
    stacks = [m for m in draft.modules() if isinstance(m, ExpertLinear)]
    quantized = [m for m in stacks if m.packed is not None]
    assert all(m.weight.numel() == 0 for m in quantized)
    assert (len(stacks), len(quantized)) == (2, 1 if arch == "deepseek2" else 2)  # gate_up and down
    reference, spec_on, proposals = _run(llm)
    # Verifying 1 + k rows takes the small-batch kernel (int16 activations), a lone decode row the row-dot
    # one: the same tokens, logprobs within the packed kernels' batch-invariance bound (1e-3, FEATURES.md).
    for i, ((ref_tokens, ref_lps), (tokens, lps)) in enumerate(zip(reference, spec_on, strict=True)):
        assert tokens == ref_tokens, f"gguf {arch} Q8_0 mtp: prompt {i}: {tokens} vs spec-off {ref_tokens}"
        assert max(abs(a[t].logprob - b[t].logprob) for a, b in zip(ref_lps, lps) for t in a) < 1e-3
    assert sum(len(d) for _, d in proposals) > 0, "nothing was drafted"


def test_gguf_without_nextn_refuses_mtp(vocab, smollm2_tokenizer_dir, tmp_path):
    """DeepSeek-V3 as llama.cpp's converter writes it (MTP layers dropped): a refusal that says so."""
    from vllmpy import LLM
    from tests.gguf.test_gguf_deepseek2 import _write

    _, path = _write("v3-split", vocab, tmp_path)
    with pytest.raises(ValueError, match=r"no MTP layers .*llama.cpp's converter drops DeepSeek-V2/V3's MTP layers"):
        LLM(model=str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
