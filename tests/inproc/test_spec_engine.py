"""Speculative decoding with the MTP draft: exact greedy, rollback, rejection sampling, bytes (engine/speculative)."""

from __future__ import annotations

import pytest
import torch

from dsakv.engine.engine import Engine
from dsakv.engine.mtp_fit import fit_mtp, fit_prompts
from dsakv.engine.request import Request, SamplingParams
from dsakv.engine.speculative import accept_tokens
from dsakv.errors import ConfigError
from dsakv.model.loader import load_draft, load_model
from dsakv.model.tiny import make_tiny
from dsakv.plan.capacity import Deployment, plan
from dsakv.testing.config import engine_config
from dsakv.testing.engines import flat_engine

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The 12-layer tiny model with an MTP layer fitted briefly (partial acceptance: accepts and rejects)."""
    ckpt = make_tiny(tmp_path_factory.mktemp("spec"), seed=0, mtp=1)
    fit_mtp(ckpt, num_prompts=16, steps=60)
    spec, model = load_model(ckpt)
    return ckpt, spec, model, load_draft(ckpt)


def _prompts():
    """32 prompts: 16 the draft was fitted on (high acceptance), 16 fresh ones (rejections)."""
    fresh = fit_prompts(512, 48, seed=11)[32:]
    g = torch.Generator().manual_seed(3)
    extra = range(1, 33, 2)
    fresh = [p + torch.randint(2, 512, (n,), generator=g).tolist() for p, n in zip(fresh, extra, strict=True)]
    return fit_prompts(512, 16) + fresh


_REF: dict[tuple[tuple[int, ...], ...], list[list[int]]] = {}


def _reference(fitted, prompts):
    key = tuple(tuple(p) for p in prompts)
    if key not in _REF:
        _REF[key] = Engine((fitted[1], fitted[2]), engine_config(page_size=4)).generate(prompts, GREEDY)
    return _REF[key]


def _engine(fitted, k, **kw):
    _, spec, model, draft = fitted
    return flat_engine(
        (spec, model),
        page_size=4,
        check_every_step=True,
        speculative_num_steps=k,
        draft=draft,
        spec_poison_rejected=k > 0,
        **kw,
    )


def test_pool_bytes_include_the_draft_keys_as_the_planner(fitted):
    e = _engine(fitted, 2, num_pages=64)
    keys = {str(k) for k in e.pool.layout.keys}
    assert {"L12/kv", "L12/index_k"} <= keys and "L11/index_k" not in keys  # layer 11 is shared, elided
    assert e.layout.bytes_per_token == 4928 == 4480 + 4 * (64 + 16) + 4 * 32  # main + draft KV + draft index-K
    assert e.pool.nbytes == 64 * 4 * 4928
    p = plan(
        Deployment(e.spec, draft_layers=1, kv_format="fp32", index_format="fp32", page_size=4, kv_budget=e.pool.nbytes)
    ).stages[0]
    assert p.bytes_per_token_elided == 4928 and p.tokens_elided == 64 * 4
    assert _engine(fitted, 0, num_pages=64).pool.nbytes == 64 * 4 * 4480


@pytest.mark.parametrize(
    "k, kw",
    [
        (1, {}),  # batched
        (3, {"max_batch_tokens": 24}),  # chunked prefill, several chunks per prompt
        (2, {"num_pages": 40, "max_batch_tokens": 64}),  # preemption
        (2, {"enable_prefix_cache": True, "max_batch_tokens": 48}),  # prefix hits (shared fit-prompt prefixes)
        (2, {"num_pages": 48, "hicache_ratio": 4.0, "hicache_write_policy": "write_through"}),  # host-tier reloads
    ],
)
def test_greedy_with_mtp_equals_without(fitted, k, kw):
    prompts = _prompts()  # 32 prompts batched; 16 (8 fitted + 8 fresh) for the other modes
    if kw:
        prompts = prompts[8:24]
    if kw.get("enable_prefix_cache") or "hicache_ratio" in kw:
        prompts = prompts + prompts[:8]  # the same prompts again: hits on their cached pages
    ref = _reference(fitted, prompts)
    e = _engine(fitted, k, **kw)
    assert e.generate(prompts, GREEDY) == ref
    st = e.spec_stats()
    assert st is not None and 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    assert e.speculator.stats.poisoned_slots > 0  # rejected positions were NaN-filled, and never read
    if "num_pages" in kw and "hicache_ratio" not in kw:
        assert e.stats().num_preemptions > 0
    cs = e.cache_stats()
    if kw.get("enable_prefix_cache"):
        assert cs["device_hit_tokens"] > 0
    if "hicache_ratio" in kw:
        assert cs["host_hit_tokens"] > 0
    e.check_integrity()
    assert e.allocator.num_free + sum(len(v) for v in e.allocator.owners.values()) == e.allocator.num_pages


def test_prompt_logprobs_with_mtp_equal_without(fitted):
    """Prompt logprobs come from the speculative step's own forward (they were silently left out): the same
    prompt tokens, the same top-3 token ids and logprobs as the engine without speculation, chunked prefill too."""
    prompts = _prompts()[12:20]
    sp = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=3, ignore_eos=True)

    def run(e: Engine) -> list[tuple[list[int], list]]:
        rids = [e.add_request(p, sp) for p in prompts]
        out: dict[str, tuple[list[int], list]] = {r: ([], []) for r in rids}
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id][0].extend(o.new_token_ids)
                if o.prompt_logprobs is not None:
                    out[o.request_id][1].extend(o.prompt_logprobs)
        return [out[r] for r in rids]

    want = run(Engine((fitted[1], fitted[2]), engine_config(page_size=4)))
    spec = _engine(fitted, 2, max_batch_tokens=24)  # prompts of 48+ tokens: chunked prefill
    got = run(spec)
    assert spec.speculator.stats.draft_tokens > 0
    for p, (w_ids, w_lps), (g_ids, g_lps) in zip(prompts, want, got, strict=True):
        assert len(g_ids) == 6 and g_ids == w_ids
        assert [t.token_id for t in g_lps] == p[1:] == [t.token_id for t in w_lps]
        assert [[i for i, _ in t.top] for t in g_lps] == [[i for i, _ in t.top] for t in w_lps]
        torch.testing.assert_close(
            torch.tensor([[t.logprob, *(lp for _, lp in t.top)] for t in g_lps]),
            torch.tensor([[t.logprob, *(lp for _, lp in t.top)] for t in w_lps]),
            atol=1e-4,
            rtol=0,
        )


def test_rejected_kv_is_never_visible(fitted):
    """Rejected positions are NaN after each step (poison_rejected); the outputs match, so no step read one.
    Control: a NaN row inside the visible sequence does change the logits."""
    prompts = _prompts()[8:24]
    ref = _reference(fitted, prompts)
    e = _engine(fitted, 3)
    assert e.generate(prompts, GREEDY) == ref
    assert e.speculator.stats.poisoned_slots >= e.speculator.stats.draft_tokens - e.speculator.stats.accepted_tokens
    # control: poison one visible row of a request and its next logits are NaN
    from dsakv.engine.model_runner import build_batch
    from dsakv.engine.scheduler import ScheduledChunk

    e2 = _engine(fitted, 0)
    rid = e2.add_request(prompts[0], GREEDY)
    e2.step()
    req = e2.get_request(rid)
    slot = torch.tensor([req.page_ids[0] * 4 + 1])
    from dsakv.cache.kv_access import write_tokens
    from dsakv.spec.layout import BufferKey, Kind

    write_tokens(e2.pool, BufferKey(0, Kind.KV), slot, torch.full((1, 80), float("nan")))
    batch = build_batch([ScheduledChunk(req, req.num_computed_tokens - 1, 1)], 4)  # recompute the last token
    assert torch.isnan(e2.model(batch, e2.pool)).all()


def test_rejected_pages_are_freed_after_every_step(fitted):
    e = _engine(fitted, 3, num_pages=128)
    rids = [e.add_request(p, GREEDY) for p in _prompts()[16:20]]
    while e.has_unfinished():
        e.step()
        for rid in rids:
            r = e.get_request(rid)
            if r is not None and r.num_computed_tokens:
                assert len(r.page_ids) == -(-r.num_computed_tokens // 4)  # no page beyond the computed tokens
    assert e.allocator.num_free == 128


def test_rejection_sampling_keeps_the_target_distribution():
    """Accept d ~ q with prob min(1, p/q), else draw from norm(max(p - q, 0)): the first token follows p."""
    p_logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 0.0, -2.0]), dim=-1)
    p = torch.softmax(p_logits, dim=-1)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    counts = torch.zeros(5)
    n = 4000
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        req = Request(f"r{i}", (1,), params, sampling_seed=i)
        d = int(torch.multinomial(q, 1, generator=g))
        toks = accept_tokens(req, [d], [q], torch.stack([p_logits, p_logits]))
        counts[toks[0]] += 1
    assert (counts / n - p).abs().max() < 0.025, (counts / n, p)
    # the same seed gives the same tokens
    req = Request("x", (1,), params, sampling_seed=7)
    again = Request("y", (1,), params, sampling_seed=7)
    assert accept_tokens(req, [1], [q], torch.stack([p_logits] * 2)) == accept_tokens(
        again, [1], [q], torch.stack([p_logits] * 2)
    )


def test_sampled_speculation_is_reproducible_with_a_seed(fitted):
    prompts = _prompts()[:6]
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, seed=5, ignore_eos=True)
    a = _engine(fitted, 2).generate(prompts, sp)
    b = _engine(fitted, 2).generate(prompts[:3], sp)  # another batch: same tokens per prompt
    assert a[:3] == b and len({tuple(x) for x in a}) == 6


def test_speculation_needs_an_mtp_layer(tmp_path):
    plain = make_tiny(tmp_path / "plain", seed=0, layers=2)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 0"):
        Engine(plain, speculative_num_steps=2)
    with pytest.raises(ConfigError, match="speculative_num_steps = -1"):
        Engine(plain, speculative_num_steps=-1)


def test_http_api_and_metrics_with_speculation(fitted):
    import httpx

    from dsakv.testing.servers import live_server, scrape

    prompts = _prompts()[:3]
    want = _reference(fitted, prompts)
    with live_server(_engine(fitted, 2)) as (srv, backend):
        got = []
        for p in prompts:
            body = {"prompt": p, "max_tokens": GREEDY.max_new_tokens, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            got.append(r.json()["choices"][0]["token_ids"])
        m = scrape(srv.url)
        st = backend.engine.spec_stats()
    assert got == want[:3]
    assert st is not None and st["spec_draft_tokens"] > 0
    for k, v in st.items():
        assert m[f"dsakv_{k}"] == pytest.approx(v)
    assert m["dsakv_kv_bytes_per_token"] == 4928


def test_cli_speculative_flags(fitted, capsys):
    from dsakv.cli.main import main as cli_main

    ckpt = str(fitted[0])
    p = ",".join(map(str, fit_prompts(512, 1)[0]))
    args = [
        "generate",
        "--model",
        ckpt,
        "--prompt-ids",
        p,
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--page-size",
        "4",
    ]
    assert cli_main(args + ["--speculative-num-steps", "2", "--stats"]) == 0
    on = capsys.readouterr()
    assert cli_main(args) == 0
    off = capsys.readouterr()
    assert on.out == off.out and '"speculative"' in on.err
    assert cli_main(["make-tiny", str(fitted[0].parent / "x"), "--fit-mtp"]) == 2
    assert "add --mtp 1" in capsys.readouterr().err
