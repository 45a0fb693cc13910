"""The serving backend contract, re-exported where the HTTP layer looks for it.

The contract lives in dsakv.engine.backend so the disaggregated router (dsakv.disagg) can implement it without
importing the serve layer above it.
"""

from dsakv.engine.backend import FEATURES, FINISH_REASONS, GenerationBackend, TokenEvent

__all__ = ["FEATURES", "FINISH_REASONS", "GenerationBackend", "TokenEvent"]
