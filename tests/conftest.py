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

# One cluster secret for every PD process the suite starts (they inherit DSAKV_CLUSTER_SECRET_FILE) and for this
# process's own calls (as the router: in-process RouterBackend, health). require=False: in-process workers started
# without a secret still answer this process's plain calls.
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from dsakv.disagg.protocol import auth as _auth  # noqa: E402

if _auth.SECRET_ENV not in os.environ:
    os.environ[_auth.SECRET_ENV] = str(Path(tempfile.mkdtemp(prefix="dsakv-test-")) / "cluster.secret")
    _auth.write_secret(Path(os.environ[_auth.SECRET_ENV]))
_auth.use(_auth.ClusterAuth(_auth.Keyring(_auth.load_secret(os.environ[_auth.SECRET_ENV])), "router", require=False))
