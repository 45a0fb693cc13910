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
        choices=("glm_moe_dsa", "deepseek_v32"),
        default="glm_moe_dsa",
        help="glm_moe_dsa: GLM-5.2-shaped, producers 0,1,2,6,10 of 12 (default); deepseek_v32: every layer full",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same seed, same bytes")
    parser.add_argument("--layers", type=int, default=12, help="number of decoder layers (default 12)")
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

    if args.fit_mtp and args.mtp < 1:
        raise ConfigError("--fit-mtp fits the MTP layer: add --mtp 1")
    out = make_tiny(args.dir, arch=args.arch, seed=args.seed, layers=args.layers, mtp=args.mtp)
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
