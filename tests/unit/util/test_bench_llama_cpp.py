"""bench/llama_cpp.py's find_llama: the llama.cpp baseline is optional, so each missing piece is named in the
reason the bench prints when it skips the llama.cpp columns (no llama.cpp is run here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "llama_cpp.py"


def load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_find_llama_names_each_missing_piece(tmp_path):
    lc = load()
    llama, why = lc.find_llama(str(tmp_path / "none"))
    assert llama is None and why.startswith(f"{tmp_path / 'none'} does not exist")
    missing = f"no libllama.so under {tmp_path}/build/bin (is llama.cpp still building?)"
    assert lc.find_llama(str(tmp_path)) == (None, missing)
    (tmp_path / "build/bin").mkdir(parents=True)
    (tmp_path / "build/bin/llama-bench").write_text("")  # a tool without the library llama-greedy links: not enough
    assert lc.find_llama(str(tmp_path)) == (None, missing)
    (tmp_path / "build/bin/libllama.so").write_text("")
    llama, why = lc.find_llama(str(tmp_path))
    assert llama is None and why.startswith(f"no convert_hf_to_gguf.py in {tmp_path}/src")
    (tmp_path / "src").mkdir()
    (tmp_path / "src/convert_hf_to_gguf.py").write_text("")
    llama, why = lc.find_llama(str(tmp_path))
    assert why == "" and llama == lc.LlamaCpp(tmp_path / "build/bin", tmp_path / "src", None)
    (tmp_path / "include").mkdir()
    (tmp_path / "include/llama.h").write_text("")
    assert lc.find_llama(str(tmp_path))[0].include_dir == tmp_path / "include"
