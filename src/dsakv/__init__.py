"""dsakv: an ownership-aware KV-cache system for DeepSeek Sparse Attention models.

The public Python API (dsakv/api), imported on first use so that `import dsakv` stays light:

    import dsakv
    with dsakv.LLM("/tmp/tiny", page_size=16, prefix_cache=True) as llm:      # `dsakv generate`'s flags
        out = llm.generate([[5, 6, 7, 8], "Hello"], dsakv.SamplingParams(max_new_tokens=8))
    dsakv.plan("glm-5.2", role="decode", kv_budget="96.33GiB", draft_layers=1)   # `dsakv plan --json` as data
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Tensors of 2 MiB and more on transparent huge pages: PyTorch's CPU allocator madvises them MADV_HUGEPAGE when
# THP_MEM_ALLOC_ENABLE is set (read once, at torch's first allocation: import dsakv before making tensors). Decode
# streams every weight once a step; on 4 KiB pages that is a TLB miss every 4 KiB (a batch-1 step of
# bench/engine.py's checkpoint 18.2-19.7 -> 16.0-17.4 ms at 1 thread). THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

_API = ("LLM", "Completion", "SamplingParams", "TokenLogprobs", "plan")
__all__ = ["LLM", "Completion", "SamplingParams", "TokenLogprobs", "__version__", "plan"]

if TYPE_CHECKING:
    from dsakv.api import LLM, Completion, SamplingParams, TokenLogprobs


def __getattr__(name: str) -> Any:
    if name == "plan":  # the planner package, callable as the API's plan() (dsakv/plan/__init__.py)
        import sys

        import dsakv.plan

        return sys.modules["dsakv.plan"]
    if name in _API:
        import dsakv.api

        return getattr(dsakv.api, name)
    raise AttributeError(f"module 'dsakv' has no attribute {name!r}")
