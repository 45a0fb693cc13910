"""`--compile`'s decode kernels against the reference path: moe_fused.moe_one (a batch-1 MoE layer as one compiled
call: router, the picked experts read by id, shared expert, residual) within float32 summation rounding of
MoE.forward on the eager path; model/native's C small-row matmul (5-16 rows) within float32 rounding of x @ w^T,
its W_UK product (bgemv_kn) of torch.bmm, its absorbed decode attention (mla_decode) of the eager
gather / baddbmm / softmax / bmm, and its batch-1 layer tail (decode_tail) of W_UV, o_proj, RMSNorm and the MoE or
dense MLP; each None wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from dsakv.model.config import DSAConfig
from dsakv.model.gemv import ROWS, gemv, use_compiled_gemv
from dsakv.model.layers import MoE, choose_moe_path, rms_norm
from dsakv.model.moe_fused import moe_after_attention, moe_one, route
from dsakv.model.native import LIMIT, MAX_ROWS, TailMoE, bgemv_kn, decode_tail, mla_decode, moe_experts, small_gemm
from dsakv.model.tiny import tiny_config

# experts large enough that the dense path never runs (MoEWeights.blocked), as on the bench checkpoint and real
# models: a batch-1 token takes the per-expert path, the one moe_one replaces
SHAPE = {"hidden_size": 256, "moe_intermediate_size": 512, "n_routed_experts": 8, "num_experts_per_tok": 2}


def make_moe(groups: tuple[int, int], seed: int) -> MoE:
    over = {**SHAPE, "n_group": groups[0], "topk_group": groups[1]}
    cfg = DSAConfig.from_dict(tiny_config("deepseek_v32", overrides=over))
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.01)
    return moe


@pytest.fixture
def compiled():
    use_compiled_gemv(True)
    try:
        yield
    finally:
        use_compiled_gemv(False)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_moe_one_matches_eager_moe(groups, compiled):
    """One token, with and without a residual, on a MoE whose experts are large enough to be blocked (one group,
    and DeepSeek's group-limited routing, 4 groups of which 2 are kept): moe_one within 1e-5 relative of the
    eager MoE.forward, and the eager forward with --compile on returns moe_one's result (it took the kernel)."""
    moe = make_moe(groups, seed=groups[0])
    f = moe._weights()
    assert f.blocked and choose_moe_path(1, 2, 8, moe._row_macs) != "dense"
    g = torch.Generator().manual_seed(5)
    seen: set[tuple[int, ...]] = set()
    with torch.inference_mode():
        for _ in range(6):
            x, res = torch.randn(1, 256, generator=g), torch.randn(1, 256, generator=g)
            use_compiled_gemv(False)
            ref = moe.forward(x, residual=res.clone())
            ref_plain = moe.forward(x)
            ids = moe.gate.route(torch.nn.functional.linear(x, moe.gate.weight))[1]
            seen.add(tuple(sorted(ids[0].tolist())))
            use_compiled_gemv(True)
            got = moe_one(x, res, f, moe.gate)
            plain = moe_one(x, None, f, moe.gate)
            assert got is not None and plain is not None
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
            torch.testing.assert_close(plain, ref_plain, rtol=1e-5, atol=1e-5 * float(ref_plain.abs().max()))
            assert torch.equal(moe.forward(x, residual=res.clone()), got)  # MoE.forward took the kernel
    assert len(seen) > 1  # different tokens picked different experts: the kernel reads them by id


def test_moe_one_applies_to_one_float_token_only(compiled):
    moe = make_moe((1, 1), seed=3)
    f = moe._weights()
    x = torch.randn(1, 256)
    with torch.inference_mode():
        assert moe_one(x, None, f, moe.gate) is not None
        assert moe_one(torch.randn(2, 256), None, f, moe.gate) is None  # two tokens: the grouped path
        assert moe_one(x.double(), None, f, moe.gate) is None  # float32 only
        assert moe_one(x, torch.randn(1, 64), f, moe.gate) is None  # a residual of another shape
        use_compiled_gemv(False)
        assert moe_one(x, None, f, moe.gate) is None  # --compile off: the eager path


def test_small_gemm_matches_matmul():
    """model/native's C tile kernel: every row count 1..LIMIT (ragged 4-row tiles), N and K off the 4-row and
    16-lane tiles, rows of x and w with gaps (slices of wider tensors: a fused projection's column block) within
    float32 rounding of x @ w^T; None where it does not apply."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(203, 530, generator=g)
    w = wide[:, 3:520]  # [203, 517]: row stride 530, K 517 = 32 * 16 + 5
    for m in range(1, LIMIT + 1):
        x = torch.randn(m, 600, generator=g)[:, 10:527]  # row stride 600
        got = small_gemm(x, w)
        assert got is not None and got.shape == (m, 203)
        torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)
    x = torch.randn(LIMIT + 1, 517, generator=g)
    assert small_gemm(x, w) is None  # over its limit
    assert small_gemm(x[:4].double(), w.double()) is None
    assert small_gemm(x[:4, :516], w) is None  # K mismatch
    assert small_gemm(x[:4].t().contiguous().t(), w) is None  # x's rows not contiguous
    threads = torch.get_num_threads()
    one = small_gemm(x[:12], w)
    torch.set_num_threads(2)
    try:  # two OpenMP threads share the weight-row tiles: each output computed as on one, bitwise
        assert torch.equal(small_gemm(x[:12], w), one)
    finally:
        torch.set_num_threads(threads)


def test_gemv_takes_the_c_kernel_for_5_to_12_rows(compiled):
    """gemv.gemv with --compile: 1-ROWS rows on the inductor kernel, ROWS+1..MAX_ROWS on the C kernel (bitwise its
    result), more on the BLAS (None); within float32 rounding of the matmul."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 200, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for m in (1, ROWS, ROWS + 1, 11, MAX_ROWS):
            x = torch.randn(m, 200, generator=g)
            y = gemv(x, w)
            assert y is not None and y.shape == (m, 96)
            torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-4)
            if m > ROWS:
                assert torch.equal(y, small_gemm(x, w))
        assert gemv(torch.randn(MAX_ROWS + 1, 200), w) is None
    finally:
        torch.set_num_threads(threads)


def test_bgemv_kn_matches_bmm():
    """x [B, M, K] @ w [B, K, N] for M 1..4 on a weight view with N contiguous and gaps between its rows and
    batches (W_UK: the first nope rows of each head of kv_b_proj), N off the 64-column chunk (a tail of 16 + 3):
    within float32 rounding of torch.bmm; None where it does not apply."""
    g = torch.Generator().manual_seed(6)
    kvb = torch.randn(5, 40 + 24, 64 + 19 + 7, generator=g)
    w = kvb[:, :40, 7:]  # [5, 40, 83]: rows 90 apart, batches 64 * 90 apart
    for m in range(1, 5):
        x = torch.randn(5, m, 40, generator=g)
        got = bgemv_kn(x, w)
        assert got is not None and got.shape == (5, m, 83) and got.is_contiguous()
        torch.testing.assert_close(got, torch.bmm(x, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 5, 40, generator=g)
    assert bgemv_kn(x, w) is None  # more than 4 rows
    assert bgemv_kn(x[:, :2], w.transpose(1, 2).contiguous().transpose(1, 2)) is None  # N not contiguous
    assert bgemv_kn(x[:, :2].double(), w.double()) is None
    assert bgemv_kn(x[:4, :2], w) is None  # batch mismatch
    big_w, big_x = torch.randn(16, 64, 256, generator=g), torch.randn(16, 2, 64, generator=g)
    one = bgemv_kn(big_x, big_w)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # two OpenMP threads share the batches: bitwise the one-thread result
        assert torch.equal(bgemv_kn(big_x, big_w), one)
    finally:
        torch.set_num_threads(threads)


def _eager_attention(q, rows, slots, bias, scale, r):
    sel = rows[slots]  # [T, k, D]
    scores = torch.baddbmm(bias, q, sel.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32), sel[..., :r])


def test_mla_decode_matches_eager_attention():
    """The native absorbed decode attention reading the selected rows in place from a pool-like [S, D] buffer
    (row stride with a gap): heads 16 and 11 (a block of 8 and a short one), D 288 (r 256 + rope 32) and 83 (r 67:
    lane and column tails), k 1 / 7 / 130, repeated slots, -inf bias on some picks: within float32 rounding of
    gather + baddbmm + softmax + bmm; without a bias as with a zero one; None where it does not apply."""
    g = torch.Generator().manual_seed(8)
    for h, d, r in ((16, 288, 256), (11, 83, 67)):
        buf = torch.randn(300, d + 5, generator=g)
        rows = buf[:, :d]  # [S, D], rows d + 5 apart
        for t, k in ((1, 1), (2, 7), (3, 130)):
            q = torch.randn(t, h, d, generator=g)
            slots = torch.randint(0, 300, (t, k), generator=g)
            slots[0, -1] = slots[0, 0]  # a slot picked twice
            bias = torch.zeros(t, 1, k)
            if k > 2:
                bias[-1, 0, 1:3] = float("-inf")
            got = mla_decode(q, rows, slots, bias, 0.125, r)
            assert got is not None and got.shape == (t, h, r)
            want = _eager_attention(q, rows, slots, bias, 0.125, r)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            plain = mla_decode(q, rows, slots, None, 0.125, r)
            torch.testing.assert_close(plain, _eager_attention(q, rows, slots, torch.zeros(t, 1, k), 0.125, r))
    q, rows = torch.randn(1, 16, 288), torch.randn(64, 288)
    slots = torch.zeros(1, 4, dtype=torch.int64)
    assert mla_decode(q, rows, slots.int(), None, 1.0, 256) is None  # slots int64 only
    assert mla_decode(q.double(), rows.double(), slots, None, 1.0, 256) is None
    assert mla_decode(q[..., :200], rows, slots, None, 1.0, 256) is None  # D mismatch
    assert mla_decode(q, rows.t().contiguous().t(), slots, None, 1.0, 256) is None  # rows not contiguous
    q, slots = torch.randn(3, 16, 288), torch.randint(0, 64, (3, 40))
    one = mla_decode(q, rows, slots, None, 1.0, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # two OpenMP threads share the (token, head block) pairs: bitwise the one-thread result
        assert torch.equal(mla_decode(q, rows, slots, None, 1.0, 256), one)
    finally:
        torch.set_num_threads(threads)


def test_moe_after_attention_matches_projection_norm_and_moe(compiled):
    """A batch-1 layer's tail in one compiled call (o_proj onto the residual stream, the post-attention RMSNorm,
    the MoE with that stream as its residual): within 1e-5 relative of the eager o . W_o^T + stream, rms_norm and
    MoE.forward; None for two tokens, float64, a wrong stream shape, and with --compile off."""
    moe = make_moe((1, 1), seed=4)
    g = torch.Generator().manual_seed(10)
    w_o = torch.randn(256, 96, generator=g) * 0.1
    norm_w = torch.rand(256, generator=g) + 0.5
    with torch.inference_mode():
        for _ in range(3):
            o, stream = torch.randn(1, 96, generator=g), torch.randn(1, 256, generator=g)
            got = moe_after_attention(o, w_o, stream, norm_w, 1e-6, moe)
            use_compiled_gemv(False)
            h = o @ w_o.t() + stream
            want = moe.forward(rms_norm(h, norm_w, 1e-6), residual=h)
            use_compiled_gemv(True)
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert moe_after_attention(torch.randn(2, 96), w_o, torch.randn(2, 256), norm_w, 1e-6, moe) is None
        assert moe_after_attention(o.double(), w_o, stream, norm_w, 1e-6, moe) is None
        assert moe_after_attention(o, w_o, torch.randn(1, 128), norm_w, 1e-6, moe) is None
        use_compiled_gemv(False)
        assert moe_after_attention(o, w_o, stream, norm_w, 1e-6, moe) is None


def test_moe_experts_matches_the_grouped_loop(compiled):
    """model/native's moe_experts (a decode batch's routed experts in one call) within float32 rounding of the
    grouped per-expert loop (MoE._routed_grouped) for 2..LIMIT tokens: experts with 0, 1 and many rows, on the
    blocked downs and on downs that are column blocks of one wide weight (rows E*I + Is apart); bitwise the same on
    two threads; MoE.forward with --compile takes it (the loop never runs) for 2..LIMIT tokens and not for more;
    None where it does not apply (LIMIT + 1 tokens, an expert id out of range, float64)."""
    moe = make_moe((1, 1), seed=3)
    f = moe._weights()
    assert f.blocked and f.down.is_contiguous()
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(256, 8 * 512 + 64, generator=g) * 0.05  # [hidden, E*I + Is]: each expert a column block
    strided = wide[:, : 8 * 512].view(256, 8, 512).permute(1, 0, 2)
    assert strided.stride() == (512, 8 * 512 + 64, 1)
    with torch.inference_mode():
        for n in (2, 3, 7, LIMIT):
            x = torch.randn(n, 256, generator=g)
            weights, ids = moe.gate(x)
            ids[0] = torch.tensor([0, 1])  # expert 1 and 0 picked: the rest by the router
            if n > 2:
                ids[1:3] = torch.tensor([5, 6])  # experts 5 and 6 for tokens 1 and 2 (a token's picks distinct)
            for down in (f.down, strided):
                got = moe_experts(x, ids, weights, f.gate_up, down)
                ref = moe._routed_grouped(x, weights, ids, f._replace(down=down)) if down is f.down else None
                if ref is None:  # the strided downs: the loop by hand (what _routed_grouped computes)
                    ref = torch.zeros_like(x)
                    for e in range(8):
                        rows = (ids == e).nonzero()
                        if len(rows):
                            gu = x[rows[:, 0]] @ f.gate_up[e].t()
                            y = (torch.nn.functional.silu(gu[:, :512]) * gu[:, 512:]) @ down[e].t()
                            ref.index_add_(0, rows[:, 0], y * weights[rows[:, 0], rows[:, 1], None])
                assert got is not None and got.shape == (n, 256)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        x = torch.randn(LIMIT, 256, generator=g)
        weights, ids = moe.gate(x)
        one = moe_experts(x, ids, weights, f.gate_up, f.down)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(moe_experts(x, ids, weights, f.gate_up, f.down), one)
        finally:
            torch.set_num_threads(threads)
        big = torch.randn(LIMIT + 1, 256, generator=g)
        bw, bi = moe.gate(big)
        assert moe_experts(big, bi, bw, f.gate_up, f.down) is None
        assert moe_experts(x, ids.clamp(max=7) + 1, weights, f.gate_up, f.down) is None  # id 8 of 8 experts
        assert moe_experts(x.double(), ids, weights.double(), f.gate_up.double(), f.down.double()) is None
        calls = []
        loop = moe._routed_grouped
        moe._routed_grouped = lambda *a: calls.append(len(a[0])) or loop(*a)  # type: ignore[method-assign]
        for n in (2, LIMIT, LIMIT + 1):
            x = torch.randn(n, 256, generator=g)
            got = moe.forward(x)
            use_compiled_gemv(False)
            torch.testing.assert_close(got, moe.forward(x), rtol=1e-5, atol=1e-5)
            use_compiled_gemv(True)
        assert calls == [2, LIMIT, LIMIT + 1, LIMIT + 1], calls  # --compile: the loop only past LIMIT; eager: always


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_decode_tail_matches_w_uv_projection_norm_and_moe(groups):
    """model/native's decode_tail (a batch-1 layer after its attention core, one C call): o_lat . W_UV per head
    (heads strided as in kv_b_proj), o_proj onto the stream, RMSNorm, then MoE.forward with that stream as its
    residual (the router's group-limited choice included: it picks other experts than an ungrouped choice in some
    draws) or a dense MLP, within 1e-5 relative of the eager ops; bitwise the same on 1 and 2 threads; None where it
    does not apply (v not a multiple of 8, float64, top_k over 16, rows not contiguous)."""
    moe = make_moe(groups, seed=5)
    f, gate = moe.one_token_weights(), moe.gate
    assert f is not None
    g = torch.Generator().manual_seed(11)
    kv_b = torch.randn(4, 8 + 8, 16, generator=g) * 0.2  # [H, nope + v, r]: W_UV is each head's last 8 rows
    w_uv, w_o = kv_b[:, 8:], torch.randn(256, 32, generator=g) * 0.1
    norm_w = torch.rand(256, generator=g) + 0.5
    choice = (gate.top_k, gate.n_group, gate.topk_group, bool(gate.norm_topk_prob), float(gate.routed_scaling_factor))
    mlp = TailMoE(f.tail, gate.e_score_correction_bias, *choice, f.gate_up, f.down, f.shared_down)
    w_gu, w_dn = torch.randn(2 * 48, 256, generator=g) * 0.1, torch.randn(256, 48, generator=g) * 0.1
    moe_tail, dense_tail = decode_tail(w_uv, w_o, norm_w, 1e-6, mlp), decode_tail(w_uv, w_o, norm_w, 1e-6, (w_gu, w_dn))
    assert moe_tail is not None and dense_tail is not None
    regroup = []
    with torch.inference_mode():
        for _ in range(6):
            o_lat, stream = torch.randn(1, 4, 16, generator=g), torch.randn(1, 256, generator=g)
            h = torch.einsum("hr,hvr->hv", o_lat[0], w_uv).reshape(1, 32) @ w_o.t() + stream
            xn = rms_norm(h, norm_w, 1e-6)
            want = moe.forward(xn, residual=h)
            got = moe_tail(o_lat, stream)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            gu = xn @ w_gu.t()
            dense = (torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:]) @ w_dn.t() + h
            torch.testing.assert_close(
                dense_tail(o_lat, stream), dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max())
            )
            logits = xn @ gate.weight.t()
            ungrouped = route(logits, gate.e_score_correction_bias, gate.top_k, 1, 1, True, 1.0)[1]
            regroup.append(set(gate(xn)[1][0].tolist()) != set(ungrouped[0].tolist()))
        assert any(regroup) == (groups[1] < groups[0])
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(moe_tail(o_lat, stream), got)
        finally:
            torch.set_num_threads(threads)
    assert decode_tail(kv_b[:, 10:], torch.randn(256, 24), norm_w, 1e-6, mlp) is None  # v = 6
    assert decode_tail(w_uv.double(), w_o.double(), norm_w.double(), 1e-6, (w_gu.double(), w_dn.double())) is None
    assert decode_tail(w_uv, w_o, norm_w, 1e-6, mlp._replace(top_k=17)) is None
    assert decode_tail(w_uv, w_o.t().contiguous().t(), norm_w, 1e-6, mlp) is None
