"""MTP speculative decoding over TP ranks: `dsakv generate --tp-size 2 --speculative-num-steps 2` and `dsakv serve
--tp-size 2 --speculative-num-steps 2` run two rank processes (gloo on 127.0.0.1), each with its shard of the target
and of the draft layer (model/parallel.load_tp_draft) and the draft's KV / index-K in its own pool. Tokens and accept
counts equal the single-rank engine with MTP (greedy also == MTP off), every rank agrees on every step's drafts
(engine/tp_spec.agree_step), 0 pages used after."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dsakv.cli.main import main
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_config, load_draft, load_model
from dsakv.model.parallel import TPGroup, load_tp_draft
from dsakv.testing.cluster import wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import fitted_mtp_tiny, mtp_prompts
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

pytestmark = [pytest.mark.timeout(600)]

K = 2
NEW = 12
LONG_A = 240  # tokens of the request that must still run while the next one is placed
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The 12-layer tiny model with one MTP layer fitted on fit_prompts (drafts accepted there, rarely elsewhere)."""
    return fitted_mtp_tiny(tmp_path_factory.mktemp("tp-mtp"))


def _prompts() -> list[list[int]]:
    return mtp_prompts(2, (6, 23), seed=5)


PROMPTS = _prompts()


def _single(ckpt, params: SamplingParams, k: int = K, prompts=PROMPTS) -> tuple[list[list[int]], dict | None]:
    cfg = engine_config(page_size=4, max_tokens=1024)
    eng = Engine(load_model(ckpt), cfg, speculative_num_steps=k, model_dir=ckpt)
    out = eng.generate(prompts, params)
    assert eng.stats().pages_used == 0
    return out, eng.spec_stats()


def _generate(ckpt, capsys, *extra: str) -> tuple[list[list[int]], dict, dict]:
    argv = ["generate", "--model", str(ckpt), "--max-new-tokens", str(NEW), "--ignore-eos", "--page-size", "4"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    argv += ["--max-tokens", "1024", "--threads", "1", "--json", "--stats", "--speculative-num-steps", str(K)]
    assert main([*argv, "--tp-size", "2", *extra]) == 0
    cap = capsys.readouterr()
    lines = [json.loads(x) for x in cap.err.splitlines() if x.startswith("{")]
    stats = next(x for x in lines if "pages_used" in x)
    spec = next(x["speculative"] for x in lines if "speculative" in x)
    return [r["output_ids"] for r in json.loads(cap.out)], stats, spec


def test_draft_shards_partition_the_mtp_layer(ckpt) -> None:
    """Rank r of 2 holds heads [2r, 2r+2) of the draft's q_b / kv_b / o_proj and half of every expert of its MoE;
    eh_proj and the norms are the whole tensors; the block all-reduces through the group."""
    whole = load_draft(ckpt).state_dict()
    parts = [load_tp_draft(ckpt, TPGroup(r, 2)) for r in range(2)]
    sd = [p.state_dict() for p in parts]
    a = "layers.0.block.self_attn."
    assert torch.equal(torch.cat([s[a + "o_proj.weight"] for s in sd], 1), whole[a + "o_proj.weight"])
    assert torch.equal(torch.cat([s[a + "q_b_proj.weight"] for s in sd], 0), whole[a + "q_b_proj.weight"])
    e = "layers.0.block.mlp.experts.5."
    assert torch.equal(torch.cat([s[e + "down_proj.weight"] for s in sd], 1), whole[e + "down_proj.weight"])
    for name in ("layers.0.eh_proj.weight", "layers.0.enorm.weight", "layers.0.shared_head.norm.weight"):
        assert torch.equal(sd[0][name], whole[name]) and torch.equal(sd[1][name], whole[name])
    heads = load_config(ckpt)["num_attention_heads"]
    assert [p.layers[0].block.self_attn.num_heads for p in parts] == [heads // 2] * 2
    assert [p.layers[0].block.reduce.rank for p in parts] == [0, 1]


def test_generate_tp2_mtp_equals_single_rank(ckpt, capsys) -> None:
    tp, stats, spec = _generate(ckpt, capsys)
    one, one_spec = _single(ckpt, GREEDY)
    off, _ = _single(ckpt, GREEDY, k=0)
    assert tp == one == off
    assert all(len(t) == NEW for t in tp)
    assert spec == one_spec
    assert spec["spec_accepted_tokens"] > 0 and spec["spec_draft_tokens"] > spec["spec_accepted_tokens"]
    assert stats["pages_used"] == 0 and stats["generated_tokens"] == NEW * len(PROMPTS)
    # seeded sampling: rejection sampling draws the same numbers on both ranks and in the single-rank engine
    tp_s, stats_s, spec_s = _generate(ckpt, capsys, "--temperature", "0.9", "--seed", "11")
    one_s, one_spec_s = _single(ckpt, SEEDED)
    assert tp_s == one_s and spec_s == one_spec_s
    assert stats_s["pages_used"] == 0 and tp_s != tp


DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]


def test_generate_dp2_mtp_equals_single_rank(ckpt, capsys) -> None:
    """DP attention 2 + EP 2 with MTP: each rank speculates for its own prompts (i % 2 == rank) with the whole draft
    layer (its MoE not expert-parallel: no collective in the draft). Tokens == one rank with MTP == MTP off; rank
    0's accept counts == the single-rank engine running rank 0's prompts."""
    dp, stats, spec = _generate(ckpt, capsys, *DP)
    one, _ = _single(ckpt, GREEDY)
    assert dp == one == _single(ckpt, GREEDY, k=0)[0]
    assert spec == _single(ckpt, GREEDY, prompts=PROMPTS[0::2])[1]
    assert stats["pages_used"] == 0 and stats["generated_tokens"] == NEW * len(PROMPTS[0::2])
    tp_s, _, _ = _generate(ckpt, capsys, *DP, "--temperature", "0.9", "--seed", "11")
    assert tp_s == _single(ckpt, SEEDED)[0]
    # a DP-attention prefill role does not speculate yet: refused before anything starts (a DP-attention decode
    # does: tests/cluster/test_disagg_dp_mtp.py)
    argv = ["serve", "--role", "prefill", "--model", str(ckpt), "--port", str(free_ports(3)), *DP]
    assert main([*argv, "--speculative-num-steps", "2"]) == 2
    assert "--enable-dp-attention with --role prefill --speculative-num-steps is not supported yet" in (
        capsys.readouterr().err
    )


def _health(url: str) -> dict:
    """/health's body when it answers 200, else {} (polled again)."""
    try:
        r = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return {}
    return r.json() if r.status_code == 200 else {}


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("dsakv_") and "{" not in line:
            name, _, v = line.partition(" ")
            out[name] = float(v)
    return out


def test_serve_tp2_mtp_equals_single_rank(ckpt, tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(ckpt), "--port", str(port), "--page-size", "4", "--max-tokens", "1024",
        "--threads", "1", "--tp-size", "2", "--speculative-num-steps", str(K),
    )  # fmt: skip
    p = Proc("serve-tp2-mtp", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _health(url), 240, "serve --tp-size 2 --speculative-num-steps 2", [p])

        def post(body: dict) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        greedy = [{"prompt": q, "max_tokens": NEW, "temperature": 0, "ignore_eos": True} for q in PROMPTS]
        # one at a time: each request's accept count is the single-rank engine's running it alone
        got = [post(b) for b in greedy]
        alone = [_single(ckpt, GREEDY, prompts=[q]) for q in PROMPTS]
        assert got == [a[0][0] for a in alone]
        m = _metrics(url)
        for key in ("spec_accepted_tokens", "spec_draft_tokens", "spec_verify_steps"):
            assert m[f"dsakv_{key}"] == sum(a[1][key] for a in alone), key
        assert m["dsakv_spec_accepted_tokens"] > 0
        # concurrent, greedy and seeded: the tokens of the single-rank engine with MTP
        seeded = [{**b, "temperature": 0.9, "seed": 11} for b in greedy[:2]]
        with ThreadPoolExecutor(4) as ex:
            both = list(ex.map(post, greedy + seeded))
        assert both[: len(PROMPTS)] == got
        assert both[len(PROMPTS) :] == _single(ckpt, SEEDED, prompts=PROMPTS[:2])[0]
        wait_for(lambda: _health(url).get("pages_used") == 0, 60, "pages freed", [p])
        p.stop(timeout=60)
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "RanksDiverged" not in log and "TP group stopped: tp rank 1 exited 0" in log, log


def test_serve_dp2_mtp_equals_single_rank(ckpt, tmp_path) -> None:
    """Colocated DP attention 2 with MTP: A (long) placed on rank 0, then B while A still runs goes to rank 1, each
    speculating on its own rank; tokens == one rank with MTP; 0 pages used on both ranks after."""
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(ckpt), "--port", str(port), "--page-size", "4", "--max-tokens", "1024",
        "--threads", "1", *DP, "--speculative-num-steps", str(K),
    )  # fmt: skip
    p = Proc("serve-dp2-mtp", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _health(url), 240, "serve DP 2 --speculative-num-steps 2", [p])
        # A runs long enough (rounds) to still be in flight on rank 0 when B is placed, whatever the load (ci: two
        # concurrent 12-token requests both landed on rank 0 when the first finished before the second came)
        lens = (LONG_A, NEW)
        bodies = [
            {"prompt": q, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            for q, n in zip(PROMPTS[:2], lens, strict=True)
        ]
        got: dict[int, dict] = {}

        def post(i: int) -> None:
            r = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=300)
            assert r.status_code == 200, r.text
            got[i] = r.json()

        def in_flight() -> list[int]:
            return [r["in_flight"] for r in _health(url).get("dp_ranks", [])]

        threads = [threading.Thread(target=post, args=(0,))]
        threads[0].start()
        wait_for(lambda: in_flight() == [1, 0] or 0 in got, 60, "A placed", [p])
        threads.append(threading.Thread(target=post, args=(1,)))
        threads[1].start()
        wait_for(lambda: in_flight() == [1, 1] or 1 in got, 60, "B placed", [p])
        for t in threads:
            t.join(300)
        assert [got[i]["dp_rank"] for i in (0, 1)] == [0, 1], "A finished before B came: raise LONG_A"
        for i, n in enumerate(lens):
            want = _single(ckpt, SamplingParams(max_new_tokens=n, ignore_eos=True), prompts=[PROMPTS[i]])[0]
            assert [got[i]["choices"][0]["token_ids"]] == want

        def settled() -> bool:
            rows = _health(url).get("dp_ranks", [])
            return [(r["pages_used"], r["in_flight"]) for r in rows] == [(0, 0)] * 2

        wait_for(settled, 60, "both DP ranks with 0 pages used", [p])
        p.stop(timeout=60)
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "DP group stopped: dp rank 1 exited 0" in log and "RankDown" not in log, log
