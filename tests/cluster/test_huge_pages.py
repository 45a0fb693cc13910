"""`import dsakv` puts tensors of 2 MiB and more on transparent huge pages (THP_MEM_ALLOC_ENABLE, read by torch's
CPU allocator at its first allocation; the loader copies what safetensors allocated into torch's memory): a loaded
model's big weights lie in mappings madvised MADV_HUGEPAGE ('hg' in /proc/self/smaps' VmFlags); the variable set
to 0 by the user keeps them off. Each case in a fresh interpreter (the allocator latches the setting)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsakv.model.tiny import make_tiny

PROBE = """
import sys
import dsakv  # first: before any tensor
from dsakv.model.loader import load_model

def flags(ptr):
    start = end = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
        elif head == "VmFlags:" and start <= ptr < end:
            return line.split()[1:]
    raise SystemExit(f"no mapping holds {ptr:#x}")

spec, model = load_model(sys.argv[1])
big = [(n, p) for n, p in model.named_parameters() if p.numel() * p.element_size() >= 2 * 1024 * 1024]
print(sorted(n for n, _ in big), sum("hg" in flags(p.data_ptr()) for _, p in big))
"""


def _probe(path, env_value: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    names, hg = out.stdout.strip().rsplit(" ", 1)
    return names, int(hg)


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    # an embedding and a lm_head of 4096 x 256 float32 (4 MiB each): the weights over 2 MiB
    over = {"vocab_size": 4096, "hidden_size": 256}
    return make_tiny(tmp_path_factory.mktemp("thp") / "m", arch="glm_moe_dsa", seed=0, overrides=over)


BIG = "['lm_head.weight', 'model.embed_tokens.weight']"


def test_import_dsakv_puts_big_weights_on_huge_pages(big_ckpt):
    assert _probe(big_ckpt, None) == (BIG, 2)


def test_user_setting_zero_keeps_4k_pages(big_ckpt):
    assert _probe(big_ckpt, "0") == (BIG, 0)
