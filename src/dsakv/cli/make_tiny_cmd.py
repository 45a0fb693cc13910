"""`dsakv make-tiny DIR`: write a small deterministic DSA checkpoint (transformers' own format).

Torch and transformers are imported inside run(), never at module top.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write config.json + model.safetensors to (created if missing)")
    parser.add_argument(
        "--arch",
        choices=("glm_moe_dsa", "deepseek_v32"),
        default="glm_moe_dsa",
        help="glm_moe_dsa: GLM-5.2-shaped, producers 0,1,2,6,10 of 12 (default); deepseek_v32: every layer full",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same seed, same bytes")
    parser.add_argument("--layers", type=int, default=12, help="number of decoder layers (default 12)")


def run(args: argparse.Namespace) -> int:
    from dsakv.model.tiny import make_tiny
    from dsakv.spec.model import ModelSpec

    out = make_tiny(args.dir, arch=args.arch, seed=args.seed, layers=args.layers)
    spec = ModelSpec.from_path(out)
    print(
        f"wrote {spec.model_type} checkpoint to {out}: {spec.num_layers} layers, producers "
        f"{list(spec.producers)}, index_topk {spec.index_topk}, vocab {spec.vocab_size}, seed {args.seed}"
    )
    return 0
