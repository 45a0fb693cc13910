"""`dsakv make-tiny DIR`: write a small deterministic DSA checkpoint (transformers' own format) and a byte-level
BPE tokenizer with a chat template (tokenizer.json + tokenizer_config.json, built locally).

Torch and transformers are imported inside run(), never at module top.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        help="directory to write config.json + model.safetensors + tokenizer.json/tokenizer_config.json to "
        "(created if missing)",
    )
    parser.add_argument(
        "--arch",
        choices=("glm_moe_dsa", "deepseek_v32", "deepseek_v4"),
        default="glm_moe_dsa",
        help="glm_moe_dsa: GLM-5.2-shaped, producers 0,1,2,6,10 of 12 (default); deepseek_v32: every layer full; "
        "deepseek_v4: DeepSeek-V4-shaped (window 8, CSA ratio 4, HCA ratio 16, hyper-connections, hash-MoE)",
    )
    parser.add_argument(
        "--layer-pattern",
        choices=("flash", "pro"),
        default="flash",
        help="deepseek_v4 only: flash = 2 window-only layers then CSA/HCA interleaved (V4-Flash); pro = 2 HCA "
        "layers then CSA/HCA interleaved (V4-Pro) (default flash)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same seed, same bytes")
    parser.add_argument("--layers", type=int, help="number of decoder layers (default 12; deepseek_v4: 6)")
    parser.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="also write N MTP (next-n) draft layers as GLM-5 / DeepSeek-V3 store them (layer index --layers + j), "
        "for --speculative-num-steps (default 0)",
    )
    parser.add_argument(
        "--fit-mtp",
        action="store_true",
        help="fit the MTP layer to the model's own greedy continuations (a short deterministic CPU run, ~20 s), "
        "so speculative decoding accepts drafts; the tiny model is random, so the draft learns the seeded fit "
        "prompts (bench/mtp.py decodes them) and stays poor on others",
    )


def run(args: argparse.Namespace) -> int:
    from dsakv.errors import ConfigError
    from dsakv.model.tiny import make_tiny
    from dsakv.spec.model import ModelSpec

    if args.arch == "deepseek_v4":
        return _run_v4(args)
    if args.fit_mtp and args.mtp < 1:
        raise ConfigError("--fit-mtp fits the MTP layer: add --mtp 1")
    out = make_tiny(args.dir, arch=args.arch, seed=args.seed, layers=args.layers or 12, mtp=args.mtp)
    spec = ModelSpec.from_path(out)
    print(
        f"wrote {spec.model_type} checkpoint to {out}: {spec.num_layers} layers, producers "
        f"{list(spec.producers)}, index_topk {spec.index_topk}, vocab {spec.vocab_size}, seed {args.seed}"
        + (f", {spec.num_draft_layers} MTP layer(s) (layer {spec.num_layers}..)" if spec.num_draft_layers else "")
        + "; byte-level BPE tokenizer with a chat template (byte b = id b+2, bos 0, eos 1)"
    )
    if args.fit_mtp:
        from dsakv.engine.mtp_fit import fit_mtp

        fit = fit_mtp(out, seed=args.seed)
        print(
            f"fitted the MTP layer in {fit['seconds']} s: draft == target on the fit prompts "
            f"{fit['agreement_before']:.3f} -> {fit['agreement_after']:.3f}, "
            f"on fresh prompts {fit['agreement_fresh']:.3f}"
        )
    return 0


def _run_v4(args: argparse.Namespace) -> int:
    from dsakv.errors import ConfigError
    from dsakv.model.deepseek_v4_tiny import make_tiny_v4
    from dsakv.spec.v4 import CSA, HCA, WINDOW, V4Spec

    if args.mtp or args.fit_mtp:
        raise ConfigError("--mtp / --fit-mtp: tiny DeepSeek-V4 checkpoints have no MTP layer yet; drop the flag")
    out = make_tiny_v4(args.dir, pattern=args.layer_pattern, seed=args.seed, layers=args.layers or 6)
    spec = V4Spec.from_path(out)
    n = {t: len(spec.layers_of(t)) for t in (WINDOW, CSA, HCA)}
    print(
        f"wrote deepseek_v4 ({args.layer_pattern} pattern) checkpoint to {out}: {spec.num_layers} layers = "
        f"{n[WINDOW]} window-only + {n[CSA]} CSA (ratio {spec.csa_ratio}) + {n[HCA]} HCA (ratio {spec.hca_ratio}), "
        f"window {spec.sliding_window}, vocab {spec.vocab_size}, seed {args.seed}"
    )
    return 0
