"""dsakv.LLM with tp_size=2 (a rank process running `dsakv serve`'s TP follower): tokens equal transformers';
close() stops the rank process (exit status 0). `import dsakv` imports neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys

import dsakv
from dsakv.testing.engines import hf_greedy, prompts_for, tiny_path

ARCH = "glm_moe_dsa"


def test_llm_tp2_equals_transformers_and_close_stops_the_rank() -> None:
    prompts = prompts_for([9, 4], seed=5)
    with dsakv.LLM(tiny_path(ARCH), tp_size=2, page_size=4, max_tokens=512, threads=1) as llm:
        children = list(llm._ranked.ranks.children)
        assert [p.name for p in children] == ["tp rank 1"] and children[0].poll() is None
        out = llm.generate(prompts, dsakv.SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in out] == [hf_greedy(ARCH, tuple(p), 6) for p in prompts]
    assert [p.poll() for p in children] == [0]  # close() waited for the rank's exit


def test_import_dsakv_is_light() -> None:
    code = "import sys, dsakv; print(sorted(m for m in ('torch', 'dsakv.api', 'dsakv.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
