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

# transformers and huggingface_hub bind their log handler to sys.stderr as it is at their first log; if that is a
# test's capsys (a test that runs main([...])), every later log of this worker goes to a closed stream ("--- Logging
# error ---" and a traceback, which the cluster tests' log scan reports: seen with test_tp_mtp after test_disagg_dp's
# flag errors on one worker). Set them up here, once, before any test captures anything.
try:
    from huggingface_hub.utils import logging as _hf_logging
    from transformers.utils import logging as _tf_logging
except ImportError:  # the planner tests run without them
    pass
else:
    _tf_logging.get_logger("transformers")
    _hf_logging.get_logger("huggingface_hub")

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


# ---- tiers: tests/unit/<layer>/ (one layer, no process, no server), tests/inproc/ (several layers in this process:
# an Engine, in-process servers and roles), tests/cluster/ (starts processes). The marker follows the directory, so
# `-m "not cluster"` and `make test-fast` (unit + inproc) select by tier; pyproject registers them (--strict-markers).
TIERS = ("unit", "inproc", "cluster")


def pytest_collection_modifyitems(items):
    import pytest

    here = Path(__file__).resolve().parent
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(here)
        tier = rel.parts[0] if len(rel.parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{rel}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


# ---- no Python traceback in any server's output (issue 26): dsakv.testing.logscan scans every log of a process the
# suite starts at the end of each test and fails its teardown with the log's path, line and block.
pytest_plugins = ("dsakv.testing.logscan",)


# ---- a test that runs `dsakv serve --role ...` in this process (main([...]) up to a startup error) sets this
# process's credentials to that role (cli/disagg_roles.use_cluster_secret); restore the suite's after each test, or
# every later test of this worker would call as that role (seen: an in-process router refused as "decode").
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_cluster_auth():
    saved = _auth.current()
    yield
    _auth.use(saved)
