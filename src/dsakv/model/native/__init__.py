"""`--compile`'s small-row float32 matmul in C (small_gemm.c): y[M, N] = x[M, K] . w[N, K]^T for 5-16 rows (decode
batches' per-expert groups and projections), where MKL's sgemm runs ~20-45 GFLOP/s on this project's CPU box, and
for one row (8 weight rows streamed side by side: the lm_head at batch 1). A
4 x 4 register tile (4 weight rows x 4 rows of x) over a K block that stays in L1 reads each weight element from
memory once per call, the rows two tiles on prefetched into L2: with the weights cold (as a decode step reads them)
x1.7-2.5 torch.mm's speed at 5 rows, x1.0-1.6 at 16 on one thread (bench/small_gemm.py) and more on two (MKL's
small-M sgemm barely uses the second thread), so gemv.gemv takes it up to MAX_ROWS = 16.

    y = small_gemm(x, w)    # x [M, K] @ w [N, K]^T as a new [M, N] tensor, or None where it does not apply
    y = bgemv_kn(x, w)      # torch.bmm(x [B, M<=4, K], w [B, K, N]) for N contiguous (W_UK: ~7 -> ~20 GB/s)
    o = mla_decode(q, rows, slots, bias, scale, r)   # the absorbed decode attention over the pool's fp32 rows
    head = decode_head(sizes, ln1, eps1, w_x, w_q, w_uk)  # a batch-1 layer's attention up to its core, bound
    tail = decode_tail(w_uv, w_o, norm_w, eps, mlp)  # a batch-1 layer after its attention core, bound to weights

bgemv_kn reads a weight whose reduction runs over its outer dimension (the absorbed attention's per-head W_UK
[H, nope, r], a view of kv_b_proj) in memory order; inductor's reduction read it at ~7 GB/s. mla_decode is one
decode layer's scores, softmax and values per token over its selected rows, read in place from the pool (no
gathered copy; ~40 us against ~70 us of index_select / baddbmm / softmax / bmm at 128 keys and 16 heads).

Applies to float32 CPU tensors, 1 <= M <= LIMIT, rows of x and w contiguous; callers fall back to the BLAS on None.
Each call runs on torch's thread count (OpenMP: the same libgomp as torch and inductor's kernels, so one pool; a
call under PARALLEL_MACS multiply-adds on the calling thread alone). Built on first use
with -O3 -march=native (GCC/Clang vector extensions: AVX-512 here, AVX2 / NEON elsewhere) into ~/.cache/dsakv
(dsakv.util.cbuild), named by the source, the flags and this CPU's feature flags; without a compiler, if the build
fails, or with DSAKV_NO_NATIVE=1, every call returns None after one warning. Its sums run in another order than the
BLAS's (~1e-6 relative). Imports torch and dsakv.util.cbuild only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from dsakv.util.cbuild import CSource, load_or_build

log = logging.getLogger(__name__)

SOURCE = CSource(Path(__file__).with_name("small_gemm.c"), flags=("-O3", "-march=native", "-fopenmp"), libs=("-lm",))
MAX_ROWS = 16  # gemv takes it for ROWS + 1 .. MAX_ROWS rows (at 16 rows: ~MKL on one thread, x1.5 on two)
LIMIT = 16  # the C kernel's own limit (MMAX)
_LIB: list[ctypes.CDLL | None | bool] = [None]  # None: not tried yet; False: unavailable (warned once)


def _cpu_tag() -> str:
    """The machine and its CPU feature flags (a -march=native build runs only where they are the same)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:8]


def _load(out: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(out))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    lib.small_gemm.argtypes = [p, i64, p, i64, p, i64, i64, i64, i64, c_int]
    lib.small_gemm.restype = ctypes.c_int
    lib.bgemv_kn.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, i64, i64, c_int]
    lib.bgemv_kn.restype = ctypes.c_int
    lib.mla_decode.argtypes = [p, i64, i64, i64, i64, p, i64, p, i64, p, ctypes.c_float, p, p, c_int]
    lib.mla_decode.restype = ctypes.c_int
    lib.moe_experts.argtypes = [p, i64, i64, p, p, i64, p, i64, p, i64, i64, i64, i64, p, p, c_int]
    lib.moe_experts.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.decode_tail.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, p, p, f32, i64, p, i64, i64, p, i64, i64, i64,
                                c_int, f32, p, i64, i64, i64, p, i64, i64, p, i64, p, p, c_int]  # fmt: skip
    lib.decode_tail.restype = ctypes.c_int
    lib.decode_head.argtypes = [p, i64, p, f32, p, i64, i64, i64, p, f32, p, f32, p, p, i64, i64, p, i64, i64, i64, p,
                                p, p, f32, p, i64, p, i64, p, p, i64, f32, p, p, c_int]  # fmt: skip
    lib.decode_head.restype = ctypes.c_int
    return lib


def _build() -> ctypes.CDLL | None:
    lib, why = load_or_build(SOURCE, f"small_gemm-{SOURCE.tag()}-{_cpu_tag()}.so", _load)
    if lib is None:
        log.warning("--compile's 5-16 row matmuls stay on the BLAS: %s", why)
    return lib


def lib() -> ctypes.CDLL | None:
    if _LIB[0] is None:
        _LIB[0] = False if os.environ.get("DSAKV_NO_NATIVE") else (_build() or False)
    out = _LIB[0]
    return out if isinstance(out, ctypes.CDLL) else None


def _plain_f32(*ts: torch.Tensor) -> bool:
    """Every tensor float32 on CPU (what the C kernels take)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def small_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ w [N, K]^T -> a new float32 [M, N] on the C kernel, or None where it does not apply (see above)."""
    if (
        not _plain_f32(x, w)
        or x.dim() != 2
        or w.dim() != 2
        or not 0 < x.shape[0] <= LIMIT
        or x.shape[1] != w.shape[1]
        or x.stride(1) != 1
        or w.stride(1) != 1
    ):
        return None
    c = lib()
    if c is None:
        return None
    m, k = int(x.shape[0]), int(x.shape[1])
    n = int(w.shape[0])
    y = torch.empty((m, n), dtype=torch.float32)
    if c.small_gemm(
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), n, m, n, k, _threads(m * n * k)
    ):
        return None
    return y


PARALLEL_MACS = 1 << 17  # a call of fewer multiply-adds runs on the calling thread (OpenMP's fork costs ~us)


def _threads(macs: int) -> int:
    """OpenMP threads for a call of `macs` multiply-adds: torch's thread count (its pool: the same libgomp), or 1
    for a small call."""
    return torch.get_num_threads() if macs >= PARALLEL_MACS else 1


def bgemv_kn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """torch.bmm(x [B, M, K], w [B, K, N]) for M <= 4 and w's N dimension contiguous (the absorbed attention's
    per-head W_UK at decode: its rows read in memory order), a new contiguous [B, M, N], or None where it does not
    apply (the caller runs torch.bmm)."""
    if (
        not _plain_f32(x, w)
        or x.dim() != 3
        or w.dim() != 3
        or not 0 < x.shape[1] <= 4
        or x.shape[0] != w.shape[0]
        or x.shape[2] != w.shape[1]
        or x.stride(2) != 1
        or w.stride(2) != 1
    ):
        return None
    c = lib()
    if c is None:
        return None
    b, m, k = (int(s) for s in x.shape)
    n = int(w.shape[2])
    y = torch.empty((b, m, n), dtype=torch.float32)
    if c.bgemv_kn(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        w.data_ptr(),
        w.stride(0),
        w.stride(1),
        y.data_ptr(),
        b,
        m,
        k,
        n,
        _threads(b * m * k * n),
    ):
        return None
    return y


def mla_decode(
    query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, bias: torch.Tensor | None, scale: float, r: int
) -> torch.Tensor | None:
    """The absorbed MLA attention of decode tokens read in place from the pool (small_gemm.c's mla_decode):
    query [T, H, D] float32, rows [S, D] the pool's float32 rows (row stride any), slots [T, k] int64 pool rows of
    each token's selected keys (in range: the caller checked them), bias [T, 1, k] or [T, k] (0 or -inf) or None,
    -> o_lat [T, H, r] = softmax(scale * q . row + bias) . row[:r], or None where it does not apply."""
    if (
        not _plain_f32(query, rows)
        or query.dim() != 3
        or rows.dim() != 2
        or rows.stride(1) != 1
        or query.shape[2] != rows.shape[1]
        or slots.dtype != torch.int64
        or slots.dim() != 2
        or slots.shape[0] != query.shape[0]
        or not 0 < r <= int(query.shape[2])
        or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != slots.numel()))
    ):
        return None
    c = lib()
    if c is None:
        return None
    t, h, d = (int(s) for s in query.shape)
    k = int(slots.shape[1])
    if k == 0:
        return None
    q = query.contiguous()
    sl = slots.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty((t, h, r), dtype=torch.float32)
    scratch = torch.empty(t * h * k, dtype=torch.float32)
    c.mla_decode(
        q.data_ptr(), t, h, d, r, rows.data_ptr(), rows.stride(0), sl.data_ptr(), k,
        None if b is None else b.data_ptr(), scale, out.data_ptr(), scratch.data_ptr(), _threads(t * h * k * d),
    )  # fmt: skip
    return out


def moe_experts(
    x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor | None:
    """A MoE layer's routed experts for x [N <= LIMIT, hidden] (small_gemm.c's moe_experts): ids [N, k] int64 and
    wts [N, k] float32 the router's picks, gate_up [E, 2I, hidden] (each expert's gate rows then its up rows, rows
    contiguous), down [E, hidden, I] (rows contiguous) -> a new [N, hidden]: each token's weighted expert outputs
    added in expert-id order (the grouped path's order; each matmul on the tile kernel), or None where it does not
    apply (the caller runs the per-expert loop)."""
    if (
        not _plain_f32(x, wts, gate_up, down)
        or x.dim() != 2
        or not 0 < x.shape[0] <= LIMIT
        or ids.dtype != torch.int64
        or ids.dim() != 2
        or ids.shape != wts.shape
        or ids.shape[0] != x.shape[0]
        or gate_up.dim() != 3
        or down.dim() != 3
        or gate_up.shape[0] != down.shape[0]
        or gate_up.shape[2] != x.shape[1]
        or down.shape[1] != x.shape[1]
        or gate_up.shape[1] != 2 * down.shape[2]
        or gate_up.stride(2) != 1
        or gate_up.stride(1) != gate_up.shape[2]
        or down.stride(2) != 1
    ):
        return None
    c = lib()
    if c is None:
        return None
    n, h = int(x.shape[0]), int(x.shape[1])
    n_exp, inter = int(gate_up.shape[0]), int(down.shape[2])
    xc, ic, wc = x.contiguous(), ids.contiguous(), wts.contiguous()
    out = torch.empty((n, h), dtype=torch.float32)
    scratch = torch.empty(n * (2 * h + 3 * inter), dtype=torch.float32)
    rc = c.moe_experts(
        xc.data_ptr(), n, h, ic.data_ptr(), wc.data_ptr(), int(ids.shape[1]), gate_up.data_ptr(), gate_up.stride(0),
        down.data_ptr(), down.stride(0), down.stride(1), inter, n_exp, out.data_ptr(), scratch.data_ptr(),
        _threads(h * 2 * inter),
    )  # fmt: skip
    return None if rc else out


class TailMoE(NamedTuple):
    """decode_tail's MoE: tail [R + 2 Is, hidden] (router | shared gate | shared up rows), the router's bias [R] and
    choice (moe_fused.route's arguments), gate_up [E, 2I, hidden], down [E, hidden, I], shared_down [hidden, Is]."""

    tail: torch.Tensor
    bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    norm: bool
    scaling: float
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_down: torch.Tensor


def decode_tail(
    w_uv: torch.Tensor,
    w_o: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    mlp: TailMoE | tuple[torch.Tensor, torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A batch-1 decoder layer's tail after its attention core as one C call (small_gemm.c's decode_tail), bound to
    its weights: tail(o_lat, stream) -> the new stream [1, hidden] for o_lat [1, H, r] (the attention's latent
    output, contiguous) and stream [1, hidden] (contiguous): o_lat . W_UV per head (w_uv [H, v, r]), the stream +
    that . w_o^T, the RMSNorm (norm_w, eps), then the MoE (`mlp` a TailMoE: the router's top-k picks, their experts
    and the shared expert) or a dense MLP (`mlp` its (gate | up [2I, hidden], down [hidden, I]) weights), plus the
    stream. None where it does not apply (the caller runs the compiled kernel): every weight float32 on CPU, rows
    contiguous, v a multiple of 8 and I of 4, top_k <= 16, at most 64 expert groups."""
    dense = not isinstance(mlp, TailMoE)
    ws = [w_uv, w_o, norm_w]
    ws += [mlp.tail, mlp.bias, mlp.gate_up, mlp.down, mlp.shared_down] if isinstance(mlp, TailMoE) else list(mlp)
    if not _plain_f32(*ws) or any(t.stride(-1) != 1 for t in ws) or w_uv.dim() != 3 or w_o.dim() != 2:
        return None
    nh, v, r = (int(s) for s in w_uv.shape)
    hid = int(w_o.shape[0])
    if w_o.shape[1] != nh * v or norm_w.shape != (hid,) or v % 8:
        return None
    if dense:
        gate_up, down = mlp[0], mlp[1]
        if gate_up.dim() != 2 or down.dim() != 2 or down.shape[0] != hid:
            return None
        inter = int(down.shape[1])
        tail = bias = shared = norm_w  # (not read)
        rr, i_s, n_exp, top_k, ng, tg, norm, scaling = 0, 0, 0, 1, 1, 1, False, 1.0
        shapes_ok = gate_up.shape == (2 * inter, hid)
        gu_se = dn_se = 0
        gu_ld, dn_ld, sd_ld = gate_up.stride(0), down.stride(0), 0
    else:
        assert isinstance(mlp, TailMoE)
        gate_up, down, shared, tail, bias = mlp.gate_up, mlp.down, mlp.shared_down, mlp.tail, mlp.bias
        if gate_up.dim() != 3 or down.dim() != 3 or shared.dim() != 2 or tail.dim() != 2:
            return None
        n_exp, inter, i_s = int(gate_up.shape[0]), int(down.shape[2]), int(shared.shape[1])
        rr = int(tail.shape[0]) - 2 * i_s
        top_k, ng, tg, norm, scaling = mlp.top_k, mlp.n_group, mlp.topk_group, mlp.norm, mlp.scaling
        shapes_ok = (
            rr == n_exp
            and bias.shape == (rr,)
            and tail.is_contiguous()
            and tail.shape[1] == hid
            and gate_up.shape[1:] == (2 * inter, hid)
            and down.shape[:2] == (n_exp, hid)
            and shared.shape[0] == hid
            and 0 < tg <= ng <= 64
            and rr % ng == 0
        )
        gu_se, dn_se = gate_up.stride(0), down.stride(0)
        gu_ld, dn_ld, sd_ld = gate_up.stride(1), down.stride(1), shared.stride(0)
    c = lib()
    if not shapes_ok or gu_ld != hid or inter % 4 or not 0 < top_k <= 16 or c is None:
        return None
    n_scratch = nh * v + 2 * hid + rr + 2 * i_s + top_k * 3 * inter + i_s + 2 * rr
    head = (nh, r, w_uv.data_ptr(), w_uv.stride(0), w_uv.stride(1), v, w_o.data_ptr(), w_o.stride(0))
    mid = (norm_w.data_ptr(), eps, hid, tail.data_ptr(), rr, i_s, bias.data_ptr(), top_k, ng, tg, int(norm),
           scaling, gate_up.data_ptr(), gu_se, inter, n_exp, down.data_ptr(), dn_se, dn_ld, shared.data_ptr(),
           sd_ld)  # fmt: skip
    keep = ws  # the weights outlive the bound call (their pointers are in it)
    fn = c.decode_tail

    def tail_call(o_lat: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        assert o_lat.shape == (1, nh, r) and o_lat.is_contiguous() and o_lat.dtype == torch.float32, o_lat.shape
        assert stream.shape == (1, hid) and stream.is_contiguous() and stream.dtype == torch.float32, stream.shape
        assert keep
        out = torch.empty((1, hid), dtype=torch.float32)
        scratch = torch.empty(n_scratch, dtype=torch.float32)
        fn(
            o_lat.data_ptr(),
            *head,
            stream.data_ptr(),
            *mid,
            out.data_ptr(),
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    return tail_call


class HeadAttn(NamedTuple):
    """decode_head's attention sizes and small weights: heads, nope / rope / kv_lora_rank / q_lora_rank widths, the
    q_a and kv_a RMSNorms, the softmax scale, and a producer's index key (ix_dim 0: a layer sharing another's) with
    its LayerNorm's weight, bias and eps."""

    heads: int
    nope: int
    rope: int
    rank: int
    q_rank: int
    q_norm: torch.Tensor
    q_eps: float
    kv_norm: torch.Tensor
    kv_eps: float
    scale: float
    ix_dim: int = 0
    k_w: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    k_eps: float = 0.0


def decode_head(
    a: HeadAttn, ln1: torch.Tensor, eps1: float, w_x: torch.Tensor, w_q: torch.Tensor, w_uk: torch.Tensor
) -> Callable[..., torch.Tensor] | None:
    """A batch-1 decoder layer's attention up to its core as one C call (small_gemm.c's decode_head), bound to its
    weights: head(x, rot, ix_rot, kv, ix, out_slots, slots) -> o_lat [1, H, rank] for the stream x [1, hidden]: the
    input RMSNorm (ln1, eps1), q_a | kv_a (| the index key) rows of w_x, their norms and ropes (rot [1, rope, rope],
    ix_rot [1, ix_dim, ix_dim]: the step's rotation matrices), the KV row (and a producer's index key) written to
    the pool's rows kv [S, rank + rope] (ix [S, ix_dim], or None for a sharing layer) at out_slots[0], the query
    (w_q's q_b rows, W_UK per head: w_uk [H, nope, rank]), and the absorbed attention over the pool rows `slots`
    [1, k] (int64, in range: the caller's). None where it does not apply (the caller runs the compiled kernel):
    float32 CPU weights, rows contiguous."""
    ix_ts = [t for t in (a.k_w, a.k_b) if t is not None] if a.ix_dim else []
    ts = [ln1, w_x, w_q, w_uk, a.q_norm, a.kv_norm, *ix_ts]
    if len(ix_ts) != (2 if a.ix_dim else 0) or not _plain_f32(*ts) or any(t.stride(-1) != 1 for t in ts):
        return None
    hid, qd, d = int(w_x.shape[1]), a.nope + a.rope, a.rank + a.rope
    ny = a.q_rank + d + a.ix_dim
    if (
        w_x.dim() != 2
        or w_x.shape[0] < ny
        or w_x.stride(0) != hid
        or w_q.dim() != 2
        or w_q.shape[0] < a.heads * qd
        or w_q.shape[1] != a.q_rank
        or w_q.stride(0) != a.q_rank
        or w_uk.shape != (a.heads, a.nope, a.rank)
        or ln1.shape != (hid,)
        or a.q_norm.shape != (a.q_rank,)
        or a.kv_norm.shape != (a.rank,)
        or any(t.shape != (a.ix_dim,) for t in ix_ts)
    ):
        return None
    c = lib()
    if c is None:
        return None
    fn, nh, ix_dim = c.decode_head, a.heads, a.ix_dim
    keep = ts  # the weights outlive the bound call (their pointers are in it)
    k_w, k_b = (ix_ts[0].data_ptr(), ix_ts[1].data_ptr()) if ix_ts else (None, None)
    n_scratch = ny + hid + a.q_rank + ix_dim + nh * (qd + d)
    front = (hid, ln1.data_ptr(), eps1, w_x.data_ptr(), a.q_rank, a.rank, a.rope, a.q_norm.data_ptr(), a.q_eps,
             a.kv_norm.data_ptr(), a.kv_eps)  # fmt: skip
    mid = (w_q.data_ptr(), nh, a.nope, w_uk.data_ptr(), w_uk.stride(0), w_uk.stride(1), ix_dim)

    def head(
        x: torch.Tensor,
        rot: torch.Tensor,
        ix_rot: torch.Tensor | None,
        kv: torch.Tensor,
        ix: torch.Tensor | None,
        out_slots: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        assert keep and x.shape == (1, hid) and x.is_contiguous() and x.dtype == torch.float32, x.shape
        assert rot.shape == (1, a.rope, a.rope) and rot.is_contiguous() and rot.dtype == torch.float32
        assert kv.dim() == 2 and kv.shape[1] == d and kv.stride(1) == 1 and kv.dtype == torch.float32
        assert (ix is None) == (ix_dim == 0) == (ix_rot is None)
        assert out_slots.dtype == slots.dtype == torch.int64 and out_slots.numel() == 1 and slots.shape[0] == 1
        assert slots.is_contiguous() and out_slots.is_contiguous()
        k = int(slots.shape[1])
        ixp, ldi, irp = None, 0, None
        if ix is not None and ix_rot is not None:
            assert ix.dim() == 2 and ix.shape[1] == ix_dim and ix.stride(1) == 1 and ix.dtype == torch.float32
            assert ix_rot.shape == (1, ix_dim, ix_dim) and ix_rot.is_contiguous() and ix_rot.dtype == torch.float32
            ixp, ldi, irp = ix.data_ptr(), ix.stride(0), ix_rot.data_ptr()
        o_lat = torch.empty((1, nh, a.rank), dtype=torch.float32)
        scratch = torch.empty(n_scratch + nh * k, dtype=torch.float32)
        fn(x.data_ptr(), *front, rot.data_ptr(), *mid, irp, k_w, k_b, a.k_eps, kv.data_ptr(), kv.stride(0), ixp, ldi,
           out_slots.data_ptr(), slots.data_ptr(), k, a.scale, o_lat.data_ptr(), scratch.data_ptr(),
           torch.get_num_threads())  # fmt: skip
        return o_lat

    return head
