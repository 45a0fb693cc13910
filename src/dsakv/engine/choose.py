"""The one place a checkpoint's architecture picks its serving engine (build.py builds Engine's own parts and is
imported by engine.py, so the choice between engines lives here):

    open_engine(model_dir, cfg)     V4ServingEngine for a DeepSeek-V4 config.json (model_type deepseek_v4),
                                    else Engine (V3.2 / GLM DSA models)
    checkpoint_vocab_size(dir)      its vocabulary, read from config.json before any weight is loaded

Imports the engines; must not import serve, disagg or cli.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from dsakv.config import EngineConfig
from dsakv.errors import ConfigError
from dsakv.spec.v4 import V4Spec, is_v4


def checkpoint_vocab_size(model_dir: Path) -> int:
    from dsakv.spec.model import ModelSpec

    spec = V4Spec.from_path(model_dir) if is_v4(str(model_dir)) else ModelSpec.from_path(model_dir)
    return int(spec.vocab_size)


def check_tp(model_dir: Path, tp_size: int) -> None:
    """ConfigError for TP ranks of a checkpoint whose engine has none (DeepSeek-V4)."""
    if tp_size > 1 and is_v4(str(model_dir)):
        raise ConfigError(f"--tp-size {tp_size}: DeepSeek-V4 is served on one rank for now; drop --tp-size")


def open_engine(model_dir: Path, cfg: EngineConfig) -> Any:
    """The serving engine of `model_dir` on one rank (Engine or V4ServingEngine: the same serving API)."""
    if not is_v4(str(model_dir)):
        from dsakv.engine.engine import Engine

        return Engine(model_dir, cfg)
    from dsakv.engine.engine import read_eos_token_ids
    from dsakv.engine.v4_serve import V4ServingEngine, v4_storage_config
    from dsakv.model.deepseek_v4 import load_v4

    model = load_v4(model_dir)
    model_hash = None
    if v4_storage_config(cfg) is not None:  # stored pages are named by the weights too
        from dsakv.cache.fingerprint import weights_fingerprint

        model_hash = weights_fingerprint(model, model_dir)
    eos = read_eos_token_ids(cast(Any, model.spec), model_dir)  # reads spec.raw and generation_config.json
    return V4ServingEngine(model, cfg, eos, model_hash)
