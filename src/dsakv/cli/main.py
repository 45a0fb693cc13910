"""The `dsakv` command: a thin argparse front over one module per subcommand.

Subcommand modules are imported lazily so `dsakv plan` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dsakv.errors import DsakvError

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> int
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("dsakv.cli.plan_cmd", "KV capacity per role and PP stage, with and without index-K elision"),
    "make-tiny": ("dsakv.cli.make_tiny_cmd", "write a small deterministic GLM-5.2-shaped checkpoint"),
    "generate": ("dsakv.cli.generate_cmd", "run the reference DSA engine on a checkpoint"),
    "serve": ("dsakv.cli.serve_cmd", "serve a model: colocated, or as prefill / decode / router"),
    "store-master": ("dsakv.cli.store_master_cmd", "run a Mooncake Store (master + memory) for the shared L3 tier"),
    "demo": ("dsakv.cli.demo_cmd", "one-command demo: tiny model, PP prefill + decode + router on 127.0.0.1"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsakv",
        description=(
            "dsakv: a KV-cache system for DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5.x) that "
            "allocates, offloads and transfers index-K only for the layers that read it."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except DsakvError as e:
        print(f"dsakv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dsakv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
