"""What a CLI subcommand imports, checked in a fresh interpreter each (a subprocess: this process has imported
everything already): `dsakv --help` loads no subcommand module, `dsakv plan` only plan's and never torch."""

from __future__ import annotations

import subprocess
import sys


def test_plan_does_not_import_torch() -> None:
    code = (
        "import sys; from dsakv.cli.main import main; "
        "main(['plan','glm-5.2','--kv-budget','96.33GiB','--json']); "
        "assert 'torch' not in sys.modules, 'plan imported torch'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_subcommands_load_lazily():
    """`dsakv --help` imports no subcommand module; `dsakv plan` only plan's (and never torch)."""
    code = (
        "import sys, contextlib, io; from dsakv.cli import main as m\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try: m.main(['--help'])\n"
        "    except SystemExit: pass\n"
        "assert 'serve' in out.getvalue() and 'make-tiny' in out.getvalue(), out.getvalue()\n"
        "cmds = sorted(n for n in sys.modules if n.startswith('dsakv.cli.') and n.endswith('_cmd'))\n"
        "assert cmds == [], cmds\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert m.main(['plan', 'glm-5.2', '--kv-budget', '1GiB']) == 0\n"
        "cmds = sorted(n for n in sys.modules if n.startswith('dsakv.cli.') and n.endswith('_cmd'))\n"
        "assert cmds == ['dsakv.cli.plan_cmd'], cmds\n"
        "heavy = [n for n in ('torch', 'dsakv.engine.engine', 'dsakv.serve.app') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
