"""Suite-wide settings: one torch thread (2-core machines spin badly with more)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:
    import torch
except ImportError:  # the planner tests run without torch
    torch = None  # type: ignore[assignment]
else:
    torch.set_num_threads(1)
