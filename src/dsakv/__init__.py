"""dsakv: an ownership-aware KV-cache system for DeepSeek Sparse Attention models.

The public Python API (dsakv/api), imported on first use so that `import dsakv` stays light:

    import dsakv
    with dsakv.LLM("/tmp/tiny", page_size=16, prefix_cache=True) as llm:      # `dsakv generate`'s flags
        out = llm.generate([[5, 6, 7, 8], "Hello"], dsakv.SamplingParams(max_new_tokens=8))
    dsakv.plan("glm-5.2", role="decode", kv_budget="96.33GiB", draft_layers=1)   # `dsakv plan --json` as data
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
