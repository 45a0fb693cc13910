"""HiSparse with attention TP 2: the latent KV and index-K are replicated, every rank runs the indexer, so every
rank picks the same top-k and keeps its own HiSparse pool (device index-K + hot rows, host KV); each step the
ranks check their rows copied, hot-buffer residency and pages held equal (engine/tp_spec.agree_step).

Checked: `dsakv generate --tp-size 2 --hisparse` greedy and seeded tokens equal the single-rank engine without
HiSparse and TP 1 with HiSparse; every rank's HiSparse counters and residency equal rank 0's (and TP 1's), every
step checked, 0 pages held; `dsakv serve --tp-size 2 --hisparse` the same over HTTP; a TP-1 prefill writes each
decode TP rank's HiSparse pool (host KV + device index-K) once over mooncake, bytes == the layout figure; DP
attention with HiSparse is refused by name.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dsakv.cli.main import main
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import Kind, KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import engine, prompts_for, tiny_model, tiny_path
from dsakv.testing.servers import scrape
from dsakv.util import ceil_div
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
# 16-row hot buffers (the top-k): contexts of 45..80 tokens evict on nearly every step
HISPARSE = ["--hisparse", "--hisparse-device-buffer-size", "16", "--hisparse-host-to-device-ratio", "4"]
TP2 = ["--tp-size", "2"]


def _argv(prompts: list[list[int]], *extra: str) -> list[str]:
    argv = ["generate", "--model", str(tiny_path(ARCH)), "--max-new-tokens", "20", "--ignore-eos", "--page-size", "4"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    return argv + ["--threads", "1", "--max-tokens", "512", "--json", "--stats", *extra]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[list[list[int]], dict]:
    """(tokens per prompt, the --stats lines by their key) of one `dsakv generate`."""
    assert main(argv) == 0
    out = capsys.readouterr()
    stats = {}
    for line in out.err.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            stats[next(iter(d))] = d
    return [r["output_ids"] for r in json.loads(out.out)], stats


def test_generate_tp2_hisparse_equals_single_rank(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([60, 30, 45], seed=7)
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    single = engine(ARCH, page_size=4, max_tokens=512).generate(prompts, greedy)
    tp1, st1 = _run(capsys, _argv(prompts, *HISPARSE))
    tp2, st2 = _run(capsys, _argv(prompts, *HISPARSE, *TP2))
    assert tp2 == tp1 == single
    one = st1["hisparse"]["hisparse"]
    assert one["steps"] == 20 and one["rows_in_total"] > 0 and 0 < one["hit_rate"] < 1, one
    assert one["rank_checked_steps"] == 0  # one rank: nothing to compare
    per_rank = st2["hisparse_per_rank"]["hisparse_per_rank"]
    assert len(per_rank) == 2
    for r, d in enumerate(per_rank):
        assert d == per_rank[0], f"TP rank {r}: {d} != rank 0 {per_rank[0]}"
        assert d["rank_checked_steps"] == d["steps"] == 20, d  # every step's rows and residency compared
        assert d["pages_used"] == 0, d
        # the same rows copied (per layer, last step and in total) and hit rate as TP 1 with HiSparse
        assert {k: v for k, v in d.items() if k not in ("residency", "pages_used", "rank_checked_steps")} == {
            k: v for k, v in one.items() if k != "rank_checked_steps"
        }
    assert st2["ranks"]["ranks"]["tp"] == 2 and st2["page_size"]["pages_used"] == 0

    seeded = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "11"]
    tp2s, st = _run(capsys, _argv(prompts[:2], *seeded, *HISPARSE, *TP2))
    want = engine(ARCH, page_size=4, max_tokens=512).generate(
        prompts[:2], SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)
    )
    assert tp2s == want and len({tuple(t) for t in tp2s}) == 2
    per_rank = st["hisparse_per_rank"]["hisparse_per_rank"]
    assert per_rank[1] == per_rank[0] and per_rank[0]["rank_checked_steps"] == 20 and per_rank[0]["pages_used"] == 0


def test_hisparse_with_dp_attention_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = _argv(prompts_for([4], seed=1), *HISPARSE, *TP2, "--dp-size", "2", "--enable-dp-attention")
    assert main([*argv, "--ep-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--hisparse with --enable-dp-attention --dp-size 2 is not supported yet: drop --hisparse, or run " in err
    assert "attention TP (--tp-size 2 without --dp-size / --enable-dp-attention / --ep-size)" in err
    assert main(_argv(prompts_for([4], seed=1), *HISPARSE, *TP2, "--pp-size", "2")) == 2
    assert "--pp-size 2 with --hisparse is not supported yet: drop one of them" in capsys.readouterr().err
    # --role prefill --tp-size 2 --hisparse and a decode's DP attention with --hisparse: test_cli_validate


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _settled(m: dict[str, float]) -> bool:
    return m["dsakv_hisparse_rank_checked_steps"] == m["dsakv_hisparse_steps"] and m["dsakv_pool_pages_used"] == 0


def test_serve_tp2_hisparse_tokens_equal_single_rank(tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(tiny_path(ARCH)), "--port", str(port), "--page-size", "4", "--max-tokens", "512",
        "--threads", "1", *TP2, *HISPARSE,
    )  # fmt: skip
    p = Proc("serve-tp2-hs", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _up(url), 240, "serve --tp-size 2 --hisparse", [p])
        prompts = prompts_for([50, 23, 37], seed=21)
        bodies = [{"prompt": q, "max_tokens": 12, "temperature": 0, "ignore_eos": True} for q in prompts]
        bodies.append({"prompt": prompts[0], "max_tokens": 12, "temperature": 0.8, "seed": 17, "ignore_eos": True})

        def post(body: dict) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(post, bodies))
        one = engine(ARCH, page_size=4, max_tokens=512)
        want = one.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        want += one.generate(prompts[:1], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=17))
        assert got == want
        # rank 0's counters; every step that ran was compared with rank 1 (rows, residency, pages held): once the
        # last step's check ran (a scrape may land between a step's start and its check)
        wait_for(lambda: _settled(scrape(url)), 30, "every HiSparse step checked, no page held", [p])
        m = scrape(url)
        assert m["dsakv_hisparse_rows_in_total"] > 0 and m["dsakv_hisparse_steps"] >= 12, m
        p.stop(timeout=60)
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "RanksDiverged" not in log and "TP rank down" not in log, log
    assert "TP group stopped: tp rank 1 exited 0" in log, log


LENGTHS = (150, 41)  # 150 = 9x the 16-row buffer
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def test_pd_decode_tp2_hisparse_from_tp1_prefill(tmp_path) -> None:
    """Prefill TP 1 -> decode TP 2 + HiSparse over mooncake: each decode rank registered its HiSparse pool's
    regions (host KV + device index-K); the prefill writes each rank's pool once (the sender rule: one holder, two
    receivers); tokens equal the single-rank engine; bytes per rank == the layout figure."""
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
    ref = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    want = ref.generate(prompts, GREEDY)
    spec = ModelSpec.from_path(tiny_path(ARCH))
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode = cluster.decode("dtp2hs", "mooncake", True, extra=[*TP2, *HISPARSE, "--worker-name", "dtp2hs"])
        prefill = cluster.prefill("p1", "mooncake", True, (spec.num_layers,))
        cluster.wait_healthy([*prefill, decode], timeout=240)
        router = cluster.router([prefill[0].addr], [decode.addr])
        assert router.wait_ready(90), router.health()
        got = run_requests(router, prompts, GREEDY, "tp2hs")
        assert [t for t, _, _ in got] == want, got
        assert {(r, e) for _, r, e in got} == {("length", None)}
        lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
        pages = sum(ceil_div(n, PAGE_SIZE) for n in LENGTHS)
        figure = pages * lay.bytes_per_page  # host KV + device index-K of every key, per rank
        host = pages * sum(b.page_bytes for k, b in lay.by_key.items() if k.kind is Kind.KV)
        assert 0 < host < figure
        h = fetch_health(decode.addr)
        assert h.kv_bytes_pairs == {"p1:0->tp0": figure, "p1:0->tp1": figure}, h.kv_bytes_pairs
        assert h.counters["kv_bytes"] == 2 * figure and h.counters["started"] == len(LENGTHS)
        assert_clean([decode.addr, prefill[0].addr], procs=cluster.procs)
        log = decode.tail(400)
        assert "hisparse: " in log and "hot buffers" in log and "RanksDiverged" not in log, decode.tail(40)
    finally:
        cluster.close()


# two real processes in one gloo group, each a HiSparse engine on the tiny checkpoint; rank 1 decodes one token
# more, so its HiSparse step, rows and residency differ: agree_step raises RanksDiverged naming the part on both
_DIVERGE = """
import sys
from dsakv.engine.ranks import Ranks, RanksDiverged
from dsakv.engine.tp_spec import agree_step
from dsakv.model.parallel import init_group
from dsakv.model.loader import load_model
from dsakv.testing.engines import drive, flat_engine, greedy_params, prompts_for
from dsakv.util.procs import exit_now

rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ranks = Ranks(init_group(rank, 2, "127.0.0.1", port))
eng = flat_engine(load_model(path), page_size=4, max_tokens=512, hisparse=True, hisparse_device_buffer_size=16)
eng.add_request(prompts_for([40], seed=3)[0], greedy_params(6 + rank))
drive(eng)
try:
    agree_step(eng, ranks)
except RanksDiverged as e:
    print("DIVERGED:", e, flush=True)
    exit_now(0)  # no interpreter teardown: gloo's may abort (SIGABRT) once the peer has gone (seen under load)
print("AGREED", flush=True)
exit_now(1)
"""


def test_agree_step_names_a_rank_whose_hisparse_rows_differ(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import dsakv

    port = free_ports(1)
    env = {**os.environ, "PYTHONPATH": str(Path(dsakv.__file__).parents[1])}
    cmd = [sys.executable, "-c", _DIVERGE]
    procs = [
        subprocess.Popen([*cmd, str(r), str(port), str(tiny_path(ARCH))], stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "DIVERGED: TP rank 1 computed other HiSparse (step, rows copied per layer, residency, pages held)" in out
        assert "(rank 0: (6, " in out, out  # rank 0's 6th HiSparse step vs rank 1's 7th
