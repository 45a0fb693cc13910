"""The `dsakv` command: a thin argparse front over one module per subcommand.

`main` imports only the module of the subcommand it runs (`dsakv --help` imports none of them, `dsakv plan` never
imports the serving stack); each module keeps torch and the engine inside run(), so parsing stays light.
`build_parser()` without arguments loads every subcommand (for tests and documentation).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from dsakv.errors import DsakvError

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> int
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("dsakv.cli.plan_cmd", "KV capacity per role and PP stage, with and without index-K elision"),
    "make-tiny": (
        "dsakv.cli.make_tiny_cmd",
        "write a small deterministic GLM-5.2 / DeepSeek-V3.2 / DeepSeek-V4-shaped checkpoint",
    ),
    "generate": ("dsakv.cli.generate_cmd", "run the reference DSA engine on a checkpoint"),
    "serve": ("dsakv.cli.serve_cmd", "serve a model: colocated, or as prefill / decode / router"),
    "store-master": ("dsakv.cli.store_master_cmd", "run a Mooncake Store (master + memory) for the shared L3 tier"),
    "cluster-secret": ("dsakv.cli.cluster_secret_cmd", "write a fresh deployment secret for --cluster-secret-file"),
    "demo": ("dsakv.cli.demo_cmd", "one-command demo: tiny model, PP prefill + decode + router on 127.0.0.1"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommands in `commands` (default: all) get their options (and their module
    imported); the others are listed with their help line."""
    load = set(COMMANDS) if commands is None else set(commands)
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
        if name in load:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (its first word that is not an option), if it is one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    from_argv = argv is None  # the process's own command (a rank process is always one), not a caller's call
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = command_of(argv)
    parser = build_parser([chosen] if chosen else [])
    args = parser.parse_args(argv)
    args._argv = argv  # what rank processes re-run (engine/ranks.py)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        rc = int(args._run(args) or 0)
    except DsakvError as e:
        print(f"dsakv {args.command}: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print(f"dsakv {args.command}: interrupted", file=sys.stderr)
        rc = 130
    if "dsakv.serve.server" in sys.modules:  # a server stopped by SIGTERM: that signal's exit status, now that
        sys.modules["dsakv.serve.server"].reraise_stop_signals()  # its caller stopped what it started
    if from_argv:
        from dsakv.util.procs import exit_now, rank_process

        if rank_process():  # a TP rank / PP stage process copy, its group left: no interpreter teardown, where
            exit_now(rc)  # gloo once aborted a rank that had stopped cleanly (util/procs.exit_now)
    return rc


if __name__ == "__main__":
    sys.exit(main())
