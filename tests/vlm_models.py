"""Tiny random-weight vision-language checkpoints (tower + projector + LM), saved by transformers with a
real tokenizer, its processor files and a Gemma-style chat template; and test images."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

GEMMA3_IMAGE_TOKENS = 16  # 32x32 pixels, 4x4 patches -> an 8x8 grid pooled 2x2 -> 16 soft tokens
# A Gemma 3 chat template cut down to what the tests render: text turns, images as <start_of_image>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def sample_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth random colours (a noise image would be averaged away by the resize)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def gemma3_processor(tokenizer_dir: str, image_size: int, image_tokens: int, chat_template: str | None = None):
    """Gemma3Processor (PIL backend) on the test tokenizer with Gemma 3's image tokens added."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tokenizer.chat_template = chat_template
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    return Gemma3Processor(images, tokenizer, image_seq_length=image_tokens, chat_template=chat_template)


def make_tiny_gemma3_vlm(tokenizer_dir: str, out: Path):
    """Gemma3ForConditionalGeneration: SigLIP 2 layers (hidden 32) on 32x32 images, 16 soft tokens per
    image, a 4-layer LM with sliding window 8 (shorter than an image) alternating with global layers.
    Returns (the transformers model, its Gemma3Processor)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    processor = gemma3_processor(tokenizer_dir, 32, GEMMA3_IMAGE_TOKENS, CHAT_TEMPLATE)
    tokenizer = processor.tokenizer
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        # No final soft-cap: transformers' Gemma3ForConditionalGeneration does not apply it (vLLM and we do;
        # real Gemma 3 checkpoints set none).
        final_logit_softcapping=None, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=4, vision_use_head=False)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # wide random weights; Gemma norms scale by (1 + w), SigLIP's LayerNorms by w
        for name, p in model.named_parameters():
            is_norm = re.search(r"norm", name) is not None
            p.normal_(0.0, 0.3 if p.dim() == 1 or is_norm else 0.15)
            if is_norm and name.endswith("weight") and "vision_tower" in name:
                p.add_(1.0)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor


def make_tiny_llava(tokenizer_dir: str, out: Path, tower: str = "clip"):
    """LlavaForConditionalGeneration on a 3-layer Llama. tower "clip": CLIP (class token) read at layer -2,
    "default" strategy (class token dropped); "siglip": SigLIP read at layers [1, -1] concatenated, "full".
    32x32 images in 8x8 patches: 16 image tokens. Returns (the transformers model, its LlavaProcessor)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens={"image_token": "<image>"})
    tokenizer.chat_template = CHAT_TEMPLATE
    vision_args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       image_size=32, patch_size=8)
    if tower == "clip":
        vision = CLIPVisionConfig(**vision_args)
        images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        layer, strategy, extra = -2, "default", 1
    else:
        vision = SiglipVisionConfig(**vision_args, vision_use_head=False)
        images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
        layer, strategy, extra = [1, -1], "full", 0
    processor = LlavaProcessor(images, tokenizer, patch_size=8, vision_feature_select_strategy=strategy,
                               num_additional_image_tokens=extra, chat_template=CHAT_TEMPLATE)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=tokenizer.image_token_id, vision_feature_layer=layer,
                         vision_feature_select_strategy=strategy)
    return _save_random(LlavaForConditionalGeneration, config, processor, out)


def mm_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def with_images(cases: list[tuple[str, list[tuple[int, int, int]]]]) -> list[tuple[str, list]]:
    """(text, [(width, height, seed), ...]) cases with their sample images drawn: fresh PIL images per call."""
    return [(text, [sample_image(*size) for size in sizes]) for text, sizes in cases]


def build_tiny_vlm(make, tokenizer_dir: str, tmp_path_factory, name: str, *args) -> tuple[str, object, object]:
    """A module fixture's body: make(tokenizer_dir, out, *args) saved under a fresh temp dir named `name`;
    returns (its path, the transformers model, its processor)."""
    out = tmp_path_factory.mktemp(name)
    model, processor = make(tokenizer_dir, out, *args)
    return str(out), model, processor


def fp32_llm(path: str, num_blocks: int = 64, **kwargs):
    """An fp32 LLM on a tiny VLM checkpoint: a small pool of 16-token blocks (kwargs override either)."""
    from vllmpy import LLM
    return LLM(model=path, dtype="float32", **{"num_blocks": num_blocks, "block_size": 16, **kwargs})


def process_like_transformers(llm, processor, text: str, images: list) -> tuple[dict, list]:
    """transformers' processor outputs (numpy) and our features for one prompt; the token ids must be equal."""
    ref = processor(text=[text], images=[images], return_tensors="np")
    _, token_ids, features = llm.engine.core.mm_processor.process(mm_prompt(text, images))
    assert token_ids == ref["input_ids"][0].tolist(), text
    return ref, features


def gate_vlm(llm, model, processor, cases: list[tuple[str, list]], max_tokens: int, label: str):
    """Greedy `max_tokens` per (text, images) with vllmpy and with transformers on the processor's
    inputs (pixel values, and token_type_ids where the processor makes them), compared as tests/gate.py.
    The prompt token ids must equal the processor's."""
    from tests.gate import GateResult, compare, reference_greedy
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    result = GateResult()
    outputs = llm.generate([mm_prompt(text, images) for text, images in cases], params, use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        ref = processor(text=[text], images=[images], return_tensors="pt")
        assert output.prompt_token_ids == ref["input_ids"][0].tolist(), text
        keys = ("pixel_values", "token_type_ids", "image_sizes") + (
            ("image_grid_thw", "mm_token_type_ids") if "image_grid_thw" in ref else ())  # Qwen-VL's M-RoPE inputs
        extra = {k: ref[k] for k in keys if k in ref}
        ref_tokens, ref_logits = reference_greedy(model, output.prompt_token_ids, max_tokens, **extra)
        completion = output.outputs[0]
        # compare() walks the shorter list: a failed request (no tokens) must not pass as strict
        assert len(completion.token_ids) == max_tokens, (label, text, completion.finish_reason)
        logprobs = [pos[t].logprob for pos, t in zip(completion.logprobs, completion.token_ids)]
        compare(result, f"{label} {text!r}", completion.token_ids, logprobs, ref_tokens, ref_logits)
    print(f"{label} {result.summary()}")
    return result


IDEFICS3_TILE_TOKENS = 16  # a 32x32 tile in 4x4 patches -> an 8x8 grid, pixel-shuffled by 2 -> 16 tokens


def make_tiny_idefics3(tokenizer_dir: str, out: Path, smolvlm: bool = False):
    """Idefics3ForConditionalGeneration (or, with `smolvlm`, SmolVLMForConditionalGeneration and its image
    processor): SigLIP-style tower 2 layers (hidden 32) on 32x32 tiles, pixel shuffle 2, a 3-layer Llama;
    images resized to a longest edge of 96 and split into up to 3x3 tiles plus the global image. Returns
    (the transformers model, its Idefics3Processor: SmolVLMProcessor writes the same image prompt but
    needs num2words and a torchvision video processor)."""
    import transformers
    from transformers import AutoTokenizer, Idefics3Processor, Idefics3VisionConfig, LlamaConfig

    family = "SmolVLM" if smolvlm else "Idefics3"
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]})
    images = getattr(transformers, f"{family}ImageProcessorPil")(size={"longest_edge": 96},
                                                                 max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=IDEFICS3_TILE_TOKENS)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=4)
    config = getattr(transformers, f"{family}Config")(
        vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    return _save_random(getattr(transformers, f"{family}ForConditionalGeneration"), config, processor, out)


def _save_random(model_class, config, processor, out: Path):
    """The model with wide random weights (greedy steps are decided; every norm here scales by w), saved
    with its processor. Returns (model, processor)."""
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = re.search(r"norm", name) is not None
            p.normal_(0.0, 0.3 if p.dim() == 1 or is_norm else 0.15)
            if is_norm and name.endswith("weight"):
                p.add_(1.0)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor


def make_tiny_mistral3(tokenizer_dir: str, out: Path):
    """Mistral3ForConditionalGeneration: a Pixtral tower 2 layers (hidden 32, 2-D rotary) on 4x4 patches,
    2x2 patch merger, a 3-layer Mistral LM; images keep their size up to a longest edge of 64, rounded up
    to whole 8-pixel merged patches. Returns (the transformers model, its PixtralProcessor)."""
    from transformers import (
        AutoTokenizer,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessorPil,
        PixtralVisionConfig,
    )

    PixtralProcessor = _pixtral_processor_class()

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    images = PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 4, "width": 4})
    processor = PixtralProcessor(images, tokenizer, patch_size=4, spatial_merge_size=2)
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         sliding_window=None, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=64, patch_size=4)
    config = Mistral3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    return _save_random(Mistral3ForConditionalGeneration, config, processor, out)


def _pixtral_processor_class():
    """transformers' PixtralProcessor without torchvision. Its module imports torchvision only for the
    torchvision image processor's module, which it reads one pure-math helper from; PyPI's torchvision
    wheels need a CUDA torch, so the import is satisfied by empty modules for that one import (transformers'
    own backend checks ran before and still say torchvision is absent). The processor then runs on
    PixtralImageProcessorPil."""
    import importlib.machinery
    import sys
    import types

    import transformers.image_processing_backends  # noqa: F401  (their torchvision checks run first)
    import transformers.processing_utils  # noqa: F401

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional")
    if "torchvision" in sys.modules:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        return PixtralProcessor
    stubs = {}
    for name in names:
        stubs[name] = types.ModuleType(name)
        stubs[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    stubs["torchvision.transforms.v2"].functional = stubs["torchvision.transforms.v2.functional"]
    sys.modules.update(stubs)
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    finally:
        for name in names:
            sys.modules.pop(name, None)
    return PixtralProcessor


def assert_gate(gate_report, llm, model, processor, cases: list[tuple[str, list]], max_tokens: int, label: str,
                description: str) -> None:
    """gate_vlm, recorded for the report; every case strict or a near-tie."""
    result = gate_vlm(llm, model, processor, cases, max_tokens, label)
    gate_report(label, result, description, len(cases))
    assert not result.failures, "\n".join(result.failures)
    assert result.strict + result.near_tie == len(cases)


def agree_batched_and_chunked(make_llm, prompts: list[dict], chunked: dict, label: str, max_tokens: int = 12) -> None:
    """Greedy tokens and logprobs of each prompt alone equal the batch's, and the batch's under the engine
    arguments `chunked` (chunks ending inside image spans, a small encoder budget)."""
    from tests.models.test_batch_invariance import _agree
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)

    def run(llm, batch):
        outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params, use_tqdm=False)]
        assert all(len(tokens) == max_tokens for tokens, _ in outputs)  # no request failed
        return outputs

    alone_llm = make_llm(enable_prefix_caching=False)
    alone = [run(alone_llm, [prompt])[0] for prompt in prompts]
    _agree(alone, run(make_llm(), prompts), "batched")
    _agree(alone, run(make_llm(**chunked), prompts), label)


# A Qwen chat template cut down to what the tests render: images as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_VL_FAMILIES = ("Qwen2_5_VL", "Qwen3VL")
QWEN3_5_FAMILIES = ("Qwen3_5", "Qwen3_5Moe")


def _qwen3_5_text(family: str) -> dict:
    """Qwen3.5's real layer pattern (3 Gated DeltaNet layers, then gated full attention; value heads 4 / key
    heads 2) with partial rotary 0.25 of head_dim 64: interleaved M-RoPE over 8 frequencies, sections 3/3/2
    (as 11/11/10 of 32 in the released models). Qwen3.5-MoE: every layer 4 experts top-2 + a shared expert.
    max_position_embeddings 512: the gate's 64-block pools then hold a whole sequence and the recurrent states."""
    text = dict(num_hidden_layers=4, head_dim=64, max_position_embeddings=512, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    if family == "Qwen3_5Moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return text


def make_tiny_qwen_vl(tokenizer_dir: str, out: Path, family: str):
    """Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration: a 2-block tower (hidden 32)
    on 4x4 patches merged 2x2, a 2-layer LM (hidden 64) with M-RoPE; images smart-resized to 8-pixel
    multiples within [256, 4096] pixels. Qwen2.5-VL: windows of 2x2 merged patches with block 1 full;
    Qwen3-VL: a learned 8x8 position table (interpolated) and deepstack features from block 0; Qwen3.5 /
    Qwen3.5-MoE (QWEN3_5_FAMILIES): that tower without DeepStack on a 4-layer hybrid LM. Returns
    (the transformers model, its processor on Qwen2VLImageProcessorPil: the image processor transformers
    picks for these files without torchvision)."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]})
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end",
                                                                             "image_pad", "video_pad")}
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 256, "longest_edge": 4096}, patch_size=4, merge_size=2,
                                      temporal_patch_size=2)
    if family == "Qwen2_5_VL":
        processor = _images_only(transformers.Qwen2_5_VLProcessor)(images, tokenizer, chat_template=QWEN_CHAT_TEMPLATE)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1], out_hidden_size=64)
        text = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    else:  # Qwen3-VL's tower (Qwen3.5's has no DeepStack) and interleaved M-RoPE
        processor = _images_only(transformers.Qwen3VLProcessor)(images, tokenizer, chat_template=QWEN_CHAT_TEMPLATE)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)
        text = dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        if family == "Qwen3VL":
            vision["deepstack_visual_indexes"] = [0]
        else:
            text = _qwen3_5_text(family)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id) | text
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"], tie_word_embeddings=False)
    return _save_random(getattr(transformers, f"{family}ForConditionalGeneration"), config, processor, out)


def _images_only(processor_class):
    """The Qwen-VL processor without its video processor (transformers' video processors need torchvision,
    whose PyPI wheels need a CUDA torch): the same image and text handling."""
    class ImagesOnly(processor_class):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImagesOnly
