"""HiSparse decode in disaggregated serving: a PP = 1 prefill writes the prompt's MLA KV straight into the
decode's host pool and its index-K into the decode's device index-K (HiSparsePool.regions() is what the decode
registers and advertises); the decode allocates only its hot buffers and swaps rows in from there.

Tokens must equal colocated plain serving for prompts many times device_buffer_size, decode elision on and off,
over mooncake. 1 prefill + 2 decode processes.
"""

from __future__ import annotations

import pytest
import torch

from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(300)]

LENGTHS = (150, 290, 40)  # 290 > max-batch-tokens 256: a two-chunk prefill; 150, 290 = 9x, 18x the buffer
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
HISPARSE = ["--hisparse", "--hisparse-device-buffer-size", "16", "--hisparse-host-to-device-ratio", "4"]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


def test_pd_hisparse_tokens_equal_colocated(tmp_path) -> None:
    prompts = _prompts()
    ref = Engine(
        tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    )
    want = ref.generate(prompts, GREEDY)
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    try:
        decodes = {e: cluster.decode(f"decode-hs-{e}", "mooncake", e, extra=HISPARSE) for e in (True, False)}
        prefill = cluster.prefill("pp1", "mooncake", True, (12,))
        cluster.wait_healthy([*decodes.values(), *prefill], timeout=180)
        for elide, dec in decodes.items():
            router = cluster.router([prefill[0].addr], [dec.addr])
            assert router.wait_ready(60), router.health()
            got = run_requests(router, prompts, GREEDY, f"hs-{elide}")
            assert [g[1:] for g in got] == [("length", None)] * len(prompts), got
            assert [g[0] for g in got] == want, f"decode elide={elide}: tokens differ from colocated serving"
            pair = router.health()["pairs"][0]
            assert pair["ok"], pair
            assert_clean([dec.addr, prefill[0].addr], procs=cluster.procs)
            router.stop()
            cluster.routers.remove(router)
        for dec in decodes.values():  # each decode ran on a HiSparse pool (its start-up log says so)
            assert "hisparse: " in dec.tail(400) and "hot buffers" in dec.tail(400), dec.tail(40)
    finally:
        cluster.close()
