"""Random PEFT LoRA adapters made by peft itself (the oracle), saved as PEFT writes them."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False


# Three shapes of adapter: attention only, MLP only with rsLoRA scaling, and every projection.
SPECS = (AdapterSpec(8, 16, tuple(ATTENTION)), AdapterSpec(4, 8, tuple(MLP), rslora=True),
         AdapterSpec(16, 8, tuple(ATTENTION + MLP)))


def make_adapter(base: torch.nn.Module, out: Path, spec: AdapterSpec, seed: int) -> torch.nn.Module:
    """peft's model of `base` + a random adapter (B non-zero, unlike peft's default init), saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), use_rslora=spec.rslora,
                        lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # wide enough that every adapter changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return model


def edit_config(path: Path, **changes) -> None:
    """Rewrite keys of a saved adapter's adapter_config.json (refusal tests)."""
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
