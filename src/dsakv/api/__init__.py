"""dsakv's public Python API (re-exported by `dsakv`): `LLM`, `Completion`, `SamplingParams`, `plan`.

Layer: above cli (it reuses the CLI's option parsing and checks); nothing in dsakv imports it but the package's
lazy names.
"""

from __future__ import annotations

from dsakv.api.llm import LLM, Completion
from dsakv.api.plan import plan
from dsakv.engine.request import SamplingParams, TokenLogprobs

__all__ = ["LLM", "Completion", "SamplingParams", "TokenLogprobs", "plan"]
