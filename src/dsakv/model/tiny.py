"""make_tiny: write a small deterministic DSA checkpoint with transformers itself (real HF format).

The config is the `tiny` preset (12 GLM-5.2-shaped layers, producers 0, 1, 2, 6, 10) or,
for arch 'deepseek_v32', the same dims with every layer full. Weights are drawn from a
seeded generator, scaled by 1/sqrt(fan_in) (times a gain) so activations stay O(1) and
greedy tokens vary; norms get 1 + noise and the router bias noise, so a loader that
mixes up tensors is caught. Imports torch and transformers (lazily), dsakv.spec.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dsakv.errors import ConfigError
from dsakv.spec.presets import preset_config

log = logging.getLogger(__name__)

ARCHS = ("glm_moe_dsa", "deepseek_v32")
GAIN = 1.0
LM_HEAD_GAIN = 4.0


def tiny_config(arch: str = "glm_moe_dsa", layers: int = 12, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of a tiny checkpoint (before transformers adds its derived fields)."""
    if arch not in ARCHS:
        raise ConfigError(f"unknown tiny arch {arch!r}: use one of {', '.join(ARCHS)}")
    if layers < 1:
        raise ConfigError(f"--layers {layers}: a model needs at least one layer")
    cfg = preset_config("tiny")
    cfg["num_hidden_layers"] = layers
    cfg["_name_or_path"] = f"tiny-{arch}"
    if arch == "deepseek_v32":
        cfg["model_type"] = "deepseek_v32"
        cfg["architectures"] = ["DeepseekV32ForCausalLM"]
        cfg.pop("index_topk_freq", None)
        cfg.pop("index_skip_topk_offset", None)
    cfg.update(overrides or {})
    return cfg


def _init_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if not t.is_floating_point() or name.endswith("inv_freq"):
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                t.copy_(0.1 * noise)
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(noise)
            else:
                fan_in = t.shape[-1]
                gain = LM_HEAD_GAIN if name == "lm_head.weight" else GAIN
                t.copy_(noise * (gain / fan_in**0.5))


def build_tiny_hf(
    arch: str = "glm_moe_dsa", seed: int = 0, layers: int = 12, overrides: dict[str, Any] | None = None
) -> torch.nn.Module:
    """The transformers model of a tiny checkpoint, initialised (float32, eval mode)."""
    cfg = tiny_config(arch, layers, overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "_name_or_path", "model_type", "torch_dtype")}
    if arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        model: torch.nn.Module = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kwargs))
    else:
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kwargs))
    _init_(model, seed)
    return model.float().eval()


def make_tiny(
    path: str | Path,
    arch: str = "glm_moe_dsa",
    seed: int = 0,
    layers: int = 12,
    overrides: dict[str, Any] | None = None,
    mtp: int = 0,
) -> Path:
    """Write the tiny checkpoint (config.json + model.safetensors) to directory `path`; returns it.

    `overrides` replaces config fields (e.g. rope_parameters for a yarn variant) before the model is built.
    `mtp` > 0 adds that many MTP (next-n) draft layers as GLM-5 / DeepSeek-V3 checkpoints store them
    (num_nextn_predict_layers, tensors model.layers.{layers + j}.*), drawn from the seeded generator too.
    """
    if mtp < 0:
        raise ConfigError(f"--mtp {mtp}: the number of MTP layers must be >= 0")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    over = dict(overrides or {})
    if mtp:
        over["num_nextn_predict_layers"] = mtp
    model = build_tiny_hf(arch, seed, layers, over)
    model.save_pretrained(str(out))
    if mtp:
        write_mtp_layers(out, init_mtp(out, mtp, seed))
    log.info("wrote tiny %s checkpoint (seed %d, %d layers, %d MTP) to %s", arch, seed, layers, mtp, out)
    return out


def init_mtp(ckpt: str | Path, num_layers: int, seed: int) -> torch.nn.Module:
    """A freshly initialised MTPDraft for the checkpoint config at `ckpt` (same scheme as the main weights)."""
    from dsakv.model.config import DSAConfig
    from dsakv.model.loader import load_config
    from dsakv.model.mtp import MTPDraft
    from dsakv.spec.model import ModelSpec

    cfg = load_config(ckpt)
    draft = MTPDraft(DSAConfig.from_dict(cfg, ModelSpec.from_dict(cfg)), num_layers).float()
    _init_(draft, seed + 7919)
    return draft


def write_mtp_layers(ckpt: str | Path, draft: torch.nn.Module) -> None:
    """Add (or replace) the draft's tensors in the checkpoint's model.safetensors under checkpoint names."""
    from safetensors.torch import load_file, save_file

    from dsakv.model.loader import load_config
    from dsakv.model.mtp import checkpoint_name

    root = Path(ckpt)
    n = int(load_config(root)["num_hidden_layers"])
    files = sorted(root.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError(f"{str(root)!r} has {len(files)} safetensors files: the tiny writer expects exactly one")
    tensors = load_file(str(files[0]))
    for name, t in draft.state_dict().items():
        tensors[checkpoint_name(name, n)] = t.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
