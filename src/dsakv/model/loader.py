"""Load a GLM-5.x / DeepSeek-V3.2 HF checkpoint (config.json + *.safetensors) into a DSAModel.

Tensor names are transformers' (model.layers.{i}.self_attn.q_a_proj.weight, ...). Accepted
variants: per-expert weights (experts.{e}.gate_proj.weight, what checkpoints and
save_pretrained write) or fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]);
block-FP8 weights with `weight_scale_inv` (128 x 128 blocks) are dequantised; MTP / next-n
layers (index >= num_hidden_layers) are skipped by load_model and read by load_draft; a missing
lm_head with tied embeddings reuses embed_tokens. Router weights, e_score_correction_bias and
indexer.weights_proj stay float32 (transformers keeps them in fp32 too).
Imports torch, safetensors, dsakv.spec, dsakv.cache.fingerprint and dsakv.model.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsakv.cache.fingerprint import LOADED_IDENTITY, VARIANT, file_identity
from dsakv.errors import ConfigError
from dsakv.model.config import DSAConfig
from dsakv.model.dsa_model import DSAModel
from dsakv.model.mtp import MTPDraft, draft_name
from dsakv.model.quant import dequantize_fp8_block, pack_int8, quantize_weights
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
FP8_BLOCK = 128


def load_config(path: str | Path) -> dict[str, Any]:
    """The config.json dict of a checkpoint directory (or of a config.json path)."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise ConfigError(f"no config.json at {str(cfg_path)!r}: pass a checkpoint directory (dsakv make-tiny DIR)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{str(cfg_path)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{str(cfg_path)!r} must hold a JSON object")
    return cfg


def _safetensors_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {str(root)!r}: it is not a checkpoint directory")
    return files


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_block(w, scale_inv, torch.float32, FP8_BLOCK)


def _convert(raw: dict[str, torch.Tensor], spec: ModelSpec, draft_layers: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> DSAModel state dict (draft_layers 0: main layers only, MTP layers skipped), or the
    MTPDraft state dict of the first `draft_layers` MTP layers (dsakv.model.mtp names)."""
    sd: dict[str, torch.Tensor] = {}
    for ckpt_name, t in raw.items():
        m = _LAYER_RE.match(ckpt_name)
        is_draft = bool(m) and int(m.group(1)) >= spec.num_layers  # type: ignore[union-attr]
        if draft_layers == 0:
            if is_draft:
                continue  # MTP / next-n layers: loaded by load_draft()
            name = ckpt_name
        else:
            mapped = draft_name(ckpt_name, spec.num_layers, draft_layers) if is_draft else None
            if mapped is None:
                continue
            name = mapped
        raw_scale = raw.get(ckpt_name + "_scale_inv")
        if name.endswith("weight_scale_inv") or name.endswith("rotary_emb.inv_freq"):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = raw_scale
            if scale is None:
                raise ConfigError(f"checkpoint tensor {name} is fp8 but has no {name}_scale_inv to dequantise it")
            t = _dequant_fp8(t, scale)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                sd[f"{prefix}{e}.gate_proj.weight"] = gate
                sd[f"{prefix}{e}.up_proj.weight"] = up
            continue
        if name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, w in enumerate(t):
                sd[f"{prefix}{e}.down_proj.weight"] = w
            continue
        sd[name] = t
    if (
        draft_layers == 0
        and "lm_head.weight" not in sd
        and spec.tie_word_embeddings
        and "model.embed_tokens.weight" in sd
    ):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


Shard = Callable[[dict[str, Any], dict[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]


def build_model(
    cfg: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    name: str,
    shard: Shard | None = None,
) -> DSAModel:
    """A DSAModel from a config dict and a state dict with transformers' names; `shard` (model/parallel.py) maps
    (config, converted state dict) to one tensor-parallel rank's before the model is built."""
    spec = ModelSpec.from_dict(cfg, name=name)
    sd = _convert(state_dict, spec)
    if shard is not None:
        cfg, sd = shard(cfg, sd)
        spec = ModelSpec.from_dict(cfg, name=name)
    dcfg = DSAConfig.from_dict(cfg, spec)
    with torch.device("meta"):
        model = DSAModel(dcfg)
    _assign(model, sd, dtype, f"checkpoint {name!r} does not match its config", "tensor")
    return model.eval()


def _assign(module: torch.nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, what: str, kind: str) -> None:
    """Check `sd` names and shapes against the (meta) `module`, cast (norm-like tensors stay fp32), assign."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{what}: {len(missing)} missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"{len(unexpected)} unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for k, ref in expected.items():
        if tuple(sd[k].shape) != tuple(ref.shape):
            raise ConfigError(
                f"checkpoint {kind} {k} has shape {tuple(sd[k].shape)} but the config implies {tuple(ref.shape)}"
            )
        t = sd[k].to(torch.float32 if k.endswith(_FP32_SUFFIXES) else dtype).contiguous()
        sd[k] = _on_huge_pages(t) if t is sd[k] else t  # (a converted tensor is torch's allocation already)
    module.load_state_dict(sd, strict=True, assign=True)


HUGE_PAGE = 2 * 1024 * 1024


def _on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of 2 MiB or more as read (memory safetensors allocated, not torch's allocator) copied into
    torch's, which puts it on transparent huge pages (dsakv/__init__.py's THP_MEM_ALLOC_ENABLE: decode streams each
    weight once a step, a TLB miss every 4 KiB otherwise); else t."""
    if (
        t.device.type != "cpu"
        or os.environ.get("THP_MEM_ALLOC_ENABLE") != "1"
        or t.numel() * t.element_size() < HUGE_PAGE
    ):
        return t
    return t.clone()


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, shard: Shard | None = None, weight_dtype: str = "model"
) -> tuple[ModelSpec, DSAModel]:
    """(spec, model) of the checkpoint in directory `path`, weights in `dtype`, on the CPU (`shard`: see
    build_model); `weight_dtype` int8 or fp8 puts every projection on that grid
    (dsakv.model.quant.quantize_weights), "model" leaves them as loaded; int8 without a shard keeps int8 storage
    (quant.pack_int8: the same weights, a quarter of the fp32 bytes)."""
    root = Path(path)
    cfg = load_config(root)
    files = _safetensors_files(root)
    log.info("loading %s: %d safetensors file(s), dtype %s", root, len(files), dtype)
    ident = file_identity(root)  # the files as read (a rewrite meanwhile: no trusted identity)
    model = build_model(cfg, _read_tensors(files), dtype=dtype, name=root.name, shard=shard)
    setattr(model, LOADED_IDENTITY, ident if file_identity(root) == ident else "")
    if weight_dtype == "int8" and shard is None:
        pack_int8(model)
    else:  # fp8, or int8 on a TP / EP shard (model/parallel.py's paths read float weights): dequantised
        quantize_weights(model, weight_dtype)
    if weight_dtype != "model":  # other weights than the files': another fingerprint (stored KV never shared)
        setattr(model, VARIANT, weight_dtype)
    log.info(
        "loaded %s: %s, %d layers (%d producers), %.1fM parameters",
        root.name,
        model.spec.model_type,
        model.spec.num_layers,
        len(model.spec.producers),
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model.spec, model


def build_draft(
    cfg: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    name: str,
    num_layers: int = 1,
    shard: Shard | None = None,
) -> MTPDraft:
    """The MTPDraft of the first `num_layers` MTP layers of a checkpoint's tensors (transformers' names); `shard`
    (model/parallel.py) maps (config, converted state dict) to one tensor-parallel rank's, as build_model."""
    spec = ModelSpec.from_dict(cfg, name=name)
    if spec.num_draft_layers < num_layers:
        raise ConfigError(
            f"checkpoint {name!r} has num_nextn_predict_layers = {spec.num_draft_layers}, so no MTP layer to draft "
            f"with ({num_layers} wanted): write one with `dsakv make-tiny DIR --mtp 1`, or turn speculative "
            "decoding off (--speculative-num-steps 0)"
        )
    sd = _convert(state_dict, spec, draft_layers=num_layers)
    if shard is not None:
        cfg, sd = shard(cfg, sd)
    dcfg = DSAConfig.from_dict(cfg, ModelSpec.from_dict(cfg, name=name))
    with torch.device("meta"):
        draft = MTPDraft(dcfg, num_layers)
    what = (
        f"checkpoint {name!r}: its MTP layer(s) {spec.num_layers}..{spec.num_layers + num_layers - 1} do not "
        "match the config"
    )
    _assign(draft, sd, dtype, what, "MTP tensor")
    return draft.eval()


def load_draft(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    weight_dtype: str = "model",
    shard: Shard | None = None,
) -> MTPDraft:
    """The MTP draft layer(s) of the checkpoint in directory `path` (layers num_hidden_layers.. of its tensors);
    `weight_dtype` and `shard` as load_model."""
    root = Path(path)
    cfg = load_config(root)
    draft = build_draft(
        cfg, _read_tensors(_safetensors_files(root)), dtype=dtype, name=root.name, num_layers=num_layers, shard=shard
    )
    quantize_weights(draft, weight_dtype)
    log.info("loaded MTP draft of %s: layer(s) %s", root.name, list(draft.layer_ids))
    return draft


_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+\.)?")


def load_experts(
    path: str | Path, wanted: dict[int, list[int]], *, dtype: torch.dtype = torch.float32
) -> dict[tuple[int, int], torch.nn.Module]:
    """The routed experts `wanted` ({layer: [expert ids]}) of the checkpoint in `path`, each an MLP in `dtype`,
    read from its safetensors files alone (only those layers' expert tensors; a fused-experts checkpoint reads
    the layer's whole fused tensor once): what a re-formed expert-parallel group loads for a dead rank's experts
    (engine/elastic.py). ConfigError names a wanted expert the checkpoint lacks."""
    from safetensors import safe_open

    from dsakv.model.layers import MLP

    root = Path(path)
    cfg = load_config(root)
    spec = ModelSpec.from_dict(cfg, name=root.name)
    dcfg = DSAConfig.from_dict(cfg, spec)
    raw: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(root):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _EXPERT_RE.match(name)
                if m is None or int(m.group(1)) not in wanted:
                    continue
                if m.group(2) is None or int(m.group(2)[:-1]) in wanted[int(m.group(1))]:
                    raw[name] = st.get_tensor(name)
    sd = _convert(raw, spec)
    out: dict[tuple[int, int], torch.nn.Module] = {}
    for layer, ids in wanted.items():
        for e in ids:
            pre = f"model.layers.{layer}.mlp.experts.{e}."
            part = {k.removeprefix(pre): v for k, v in sd.items() if k.startswith(pre)}
            with torch.device("meta"):
                mlp = MLP(dcfg.spec.hidden_size, dcfg.spec.moe_intermediate_size, fuse=False)
            _assign(mlp, part, dtype, f"checkpoint {root.name!r}: expert {e} of layer {layer}", "tensor")
            out[(layer, e)] = mlp.eval()
    return out
