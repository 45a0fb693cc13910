"""DeepSeek-V4 on a V4Pool: sliding window, CSA (ratio-4 + lightning indexer) and HCA (ratio-128) attention.

Reads a V4 checkpoint (the DeepSeek tensor names transformers' save_pretrained writes: attn.wq_a, attn.wkv,
attn.compressor.ape, ffn.experts.{e}.w1, hc_attn_fn, ...) and runs it as transformers' DeepseekV4ForCausalLM
defines it: manifold-constrained hyper-connections (Sinkhorn), shared-KV MQA with attention sinks, partial
interleaved RoPE (de-rotated on the output), grouped low-rank output projection, hash-MoE / top-k MoE with a
shared expert. Every cache read and write goes through the pool by BufferKey:

    WINDOW[slot]          ring of the last `window` K=V entries: token t at row t % window
    CSA_STATE[slot]       the last 2 x ratio tokens' [kv | gate + ape] (2 x head_dim each): token t at row t % 2r
    CSA_INDEX_STATE[slot] the same for the indexer's compressor (index_head_dim)
    HCA_STATE[slot]       the open window's online softmax: rows (max, sum of exp, weighted sum)
    CSA_KV / CSA_INDEX_K / HCA_KV   compressed entry e (tokens [e r, (e + 1) r)) on page (e r) // P

A step takes rows (one chunk of one request each: prefill chunks and decode tokens batched); dense parts run on
all tokens at once, attention per row. Only the fp32 formats are implemented. Imports torch, safetensors,
dsakv.cache and dsakv.spec; must not import engine, disagg, serve or cli.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dsakv.cache.v4_pool import V4Pool
from dsakv.errors import ConfigError
from dsakv.spec.layout import BufferKey, Kind
from dsakv.spec.v4 import CSA, WINDOW, V4Spec
from dsakv.spec.v4_layout import V4Layout

ENGINE_FORMAT = "fp32"


@dataclass(frozen=True)
class V4Row:
    """One request's chunk: tokens [start, start + len(token_ids)) of the request holding `slot` and pages."""

    slot: int
    page_ids: np.ndarray
    start: int
    token_ids: Sequence[int]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 x cos.shape[-1] channels; cos/sin broadcast against x[..., :rd/2]."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, rope * c + rot * s], dim=-1)


class DeepseekV4:
    """The model: weights by checkpoint name, a step over V4Rows on a V4Pool."""

    def __init__(self, spec: V4Spec, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> None:
        self.spec = spec
        cfg = spec.raw
        self.cfg = cfg
        self.device = torch.device(device)
        self.w = {k: v.to(self.device) for k, v in weights.items()}
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.hc = int(cfg.get("hc_mult", 4))
        self.hc_iters = int(cfg.get("hc_sinkhorn_iters", 20))
        self.hc_eps = float(cfg.get("hc_eps", 1e-6))
        self.o_groups = int(cfg.get("o_groups", 8))
        self.top_k = int(cfg.get("num_experts_per_tok", 6))
        self.n_experts = int(cfg.get("n_routed_experts", 256))
        self.routed_scale = float(cfg.get("routed_scaling_factor", 1.5))
        self.limit = float(cfg.get("swiglu_limit", 10.0))
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"scoring_func {scoring!r} is not supported: use sqrtsoftplus, softmax or sigmoid")
        self.scoring = scoring
        n_hash = cfg.get("num_hash_layers", 3)
        self.mlp_types = list(cfg.get("mlp_layer_types") or ["hash_moe"] * n_hash + ["moe"] * spec.num_layers)
        self.inv_freq = {"main": self._inv_freq("main"), "compress": self._inv_freq("compress")}
        for i in range(spec.num_layers):
            if self.mlp_types[i] == "hash_moe" and f"model.layers.{i}.ffn.gate.tid2eid" not in self.w:
                raise ConfigError(f"layer {i} is hash-MoE but the checkpoint has no model.layers.{i}.ffn.gate.tid2eid")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight by checkpoint name (what the weights fingerprint hashes)."""
        return dict(sorted(self.w.items()))

    def _inv_freq(self, which: str) -> torch.Tensor:
        rp = (self.cfg.get("rope_parameters") or {}).get(which) or {}
        rtype = rp.get("rope_type", "default")
        if rtype != "default":
            raise ConfigError(
                f"rope_parameters[{which!r}].rope_type = {rtype!r}: dsakv's V4 engine implements 'default' RoPE only"
            )
        default_theta = self.cfg.get("rope_theta", 10000.0) if which == "main" else self.cfg.get("compress_rope_theta")
        theta = float(rp.get("rope_theta", default_theta or 160000.0))
        rd = self.spec.qk_rope_head_dim
        return (1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))).to(self.device)

    def _cos_sin(self, which: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[which]
        return freqs.cos(), freqs.sin()

    # ---- layout ----------------------------------------------------------------------

    def layout(self, page_size: int | None = None) -> V4Layout:
        return V4Layout(self.spec, kv_format=ENGINE_FORMAT, index_format=ENGINE_FORMAT, page_size=page_size)

    def check_pool(self, pool: V4Pool) -> None:
        lay = pool.layout
        if (lay.kv_format, lay.index_format) != (ENGINE_FORMAT, ENGINE_FORMAT):
            raise ConfigError(
                f"V4 pool formats {lay.kv_format} / {lay.index_format}: the V4 engine runs fp32 / fp32 pools"
            )
        if lay.main_layers != tuple(range(self.spec.num_layers)) or lay.hca_state != "online":
            raise ConfigError("the V4 engine needs a pool of every main layer with online HCA state")

    # ---- blocks ----------------------------------------------------------------------

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.w[name] * _rms(x.float(), self.eps)

    def _hc(self, prefix: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post, comb, collapsed) of the hyper-connection `prefix` over streams h [N, hc, D]."""
        hc = self.hc
        flat = _rms(h.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.w[prefix + "_fn"].float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.w[prefix + "_base"].split([hc, hc, hc * hc])
        s_pre, s_post, s_comb = self.w[prefix + "_scale"].unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * s_comb + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.hc_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1)
        return post, comb, collapsed

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "softmax":
            return logits.softmax(dim=-1)
        return logits.sigmoid()

    def _swiglu(self, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, w1).clamp(max=self.limit)
        up = F.linear(x, w3).clamp(min=-self.limit, max=self.limit)
        return F.linear(F.silu(gate) * up, w2)

    def _moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.ffn."
        scores = self._score(F.linear(x, self.w[p + "gate.weight"]))
        if self.mlp_types[layer] == "hash_moe":
            idx = self.w[p + "gate.tid2eid"][ids].long()
        else:
            idx = torch.topk(scores + self.w[p + "gate.bias"], self.top_k, dim=-1, sorted=False).indices
        wts = scores.gather(1, idx)
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scale
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, pos = torch.where(idx == e)
            q = f"{p}experts.{e}."
            y = self._swiglu(x[tok], self.w[q + "w1.weight"], self.w[q + "w3.weight"], self.w[q + "w2.weight"])
            out.index_add_(0, tok, y * wts[tok, pos, None])
        s = p + "shared_experts."
        return out + self._swiglu(x, self.w[s + "w1.weight"], self.w[s + "w3.weight"], self.w[s + "w2.weight"])

    # ---- compressors -------------------------------------------------------------------

    def _entry_rows(self, pool: V4Pool, key: BufferKey, row: V4Row, entries: range) -> torch.Tensor:
        """Flat entry indices in pool.entries(key) of the request's compressed entries `entries`."""
        spec = pool.layout.buffer(key)
        ratio, epp, page = spec.ratio, spec.entries_per_page, pool.page_size  # type: ignore[union-attr]
        e = np.arange(entries.start, entries.stop, dtype=np.int64)
        flat = row.page_ids[e * ratio // page] * epp + (e * ratio % page) // ratio
        return torch.from_numpy(flat).to(self.device)

    def _csa_compress(
        self, pool: V4Pool, key: BufferKey, state_key: BufferKey, prefix: str, x: torch.Tensor, row: V4Row, d: int
    ) -> None:
        """Emit the CSA entries (overlapping Ca/Cb windows) that close in this chunk into `key`; update state."""
        r = self.spec.csa_ratio
        start, n = row.start, x.shape[0]
        pos = torch.arange(start, start + n, device=self.device)
        kv = F.linear(x, self.w[prefix + "wkv.weight"])
        gate = F.linear(x, self.w[prefix + "wgate.weight"]) + self.w[prefix + "ape"][pos % r]
        ring = pool.rows(state_key)[row.slot]  # [2r, 4d]: kv (2d) | gate (2d)
        base = max((start // r - 1) * r, 0)
        prior = torch.arange(base, start, device=self.device)
        seq = torch.cat([ring[prior % (2 * r)], torch.cat([kv, gate], dim=-1)], dim=0)  # positions base..start+n-1
        first, last = start // r, (start + n) // r
        if last > first:
            out = []
            for w in range(first, last):
                cur = seq[w * r - base : (w + 1) * r - base]
                kvs, gates = [cur[:, d : 2 * d]], [cur[:, 3 * d :]]
                if w >= 1:
                    prev = seq[(w - 1) * r - base : w * r - base]
                    kvs.insert(0, prev[:, :d])
                    gates.insert(0, prev[:, 2 * d : 3 * d])
                kv_w, g_w = torch.cat(kvs), torch.cat(gates)
                out.append((kv_w * g_w.softmax(dim=0)).sum(dim=0))
            comp = self._norm(prefix + "norm.weight", torch.stack(out))
            cos, sin = self._cos_sin("compress", torch.arange(first, last, device=self.device) * r)
            comp = _rope(comp, cos, sin)
            pool.entries(key)[self._entry_rows(pool, key, row, range(first, last))] = comp
        keep = min(n, 2 * r)
        ring[pos[-keep:] % (2 * r)] = torch.cat([kv, gate], dim=-1)[-keep:]

    def _hca_compress(self, pool: V4Pool, layer: int, x: torch.Tensor, row: V4Row) -> None:
        r = self.spec.hca_ratio
        prefix = f"model.layers.{layer}.attn.compressor."
        start, n = row.start, x.shape[0]
        pos = torch.arange(start, start + n, device=self.device)
        kv = F.linear(x, self.w[prefix + "wkv.weight"])
        gate = F.linear(x, self.w[prefix + "wgate.weight"]) + self.w[prefix + "ape"][pos % r]
        st = pool.rows(BufferKey(layer, Kind.HCA_STATE))[row.slot]  # [3, d]: max, sum, weighted sum
        key = BufferKey(layer, Kind.HCA_KV)
        t = start
        while t < start + n:
            w_end = (t // r + 1) * r
            seg = slice(t - start, min(w_end, start + n) - start)
            g, v = gate[seg], kv[seg]
            m = g.max(dim=0).values
            if t % r:  # the window opened in an earlier chunk: fold in its running state
                m = torch.maximum(st[0], m)
            e = torch.exp(g - m)
            s = e.sum(dim=0)
            a = (e * v).sum(dim=0)
            if t % r:
                c = torch.exp(st[0] - m)
                s, a = s + st[1] * c, a + st[2] * c
            t = min(w_end, start + n)
            if t == w_end:  # the window closed: emit entry t / r - 1
                w = t // r - 1
                comp = self._norm(prefix + "norm.weight", (a / s)[None])
                cos, sin = self._cos_sin("compress", torch.tensor([w * r], device=self.device))
                pool.entries(key)[self._entry_rows(pool, key, row, range(w, w + 1))] = _rope(comp, cos, sin)
            else:
                st[0], st[1], st[2] = m, s, a

    # ---- attention ----------------------------------------------------------------------

    def _attention(
        self, pool: V4Pool, layer: int, x: torch.Tensor, rows: Sequence[V4Row], pos: torch.Tensor
    ) -> torch.Tensor:
        s = self.spec
        ltype = s.layer_type(layer)
        p = f"model.layers.{layer}.attn."
        H, hd, W = s.num_attention_heads, s.head_dim, s.sliding_window
        cos, sin = self._cos_sin("main" if ltype == WINDOW else "compress", pos)
        q_res = self._norm(p + "q_norm.weight", F.linear(x, self.w[p + "wq_a.weight"]))
        q = _rms(F.linear(q_res, self.w[p + "wq_b.weight"]).view(-1, H, hd), self.eps)
        q = _rope(q, cos[:, None], sin[:, None])
        kv = _rope(self._norm(p + "norm.weight", F.linear(x, self.w[p + "wkv.weight"])), cos, sin)
        ring_all = pool.rows(BufferKey(layer, Kind.WINDOW))
        out = torch.empty_like(q)
        off = 0
        for row in rows:
            n = len(row.token_ids)
            sl = slice(off, off + n)
            off += n
            start = row.start
            tq = torch.arange(start, start + n, device=self.device)
            ring = ring_all[row.slot]
            prior = torch.arange(max(start - W + 1, 0), start, device=self.device)
            keys = torch.cat([ring[prior % W], kv[sl]], dim=0)
            kpos = torch.cat([prior, tq])
            mask = (kpos[None, :] <= tq[:, None]) & (kpos[None, :] > tq[:, None] - W)
            if ltype != WINDOW:
                ratio = s.csa_ratio if ltype == CSA else s.hca_ratio
                if ltype == CSA:
                    self._csa_compress(pool, BufferKey(layer, Kind.CSA_KV), BufferKey(layer, Kind.CSA_STATE),
                                       p + "compressor.", x[sl], row, hd)  # fmt: skip
                    self._csa_compress(pool, BufferKey(layer, Kind.CSA_INDEX_K),
                                       BufferKey(layer, Kind.CSA_INDEX_STATE), p + "indexer.compressor.", x[sl], row,
                                       s.index_head_dim)  # fmt: skip
                    ckey = BufferKey(layer, Kind.CSA_KV)
                else:
                    self._hca_compress(pool, layer, x[sl], row)
                    ckey = BufferKey(layer, Kind.HCA_KV)
                n_ent = (start + n) // ratio
                if n_ent:
                    ent = range(0, n_ent)
                    comp = pool.entries(ckey)[self._entry_rows(pool, ckey, row, ent)]
                    widx = torch.arange(n_ent, device=self.device)
                    cmask = widx[None, :] < ((tq + 1) // ratio)[:, None]
                    if ltype == CSA:
                        cmask &= self._select(pool, layer, q_res[sl], x[sl], row, tq, n_ent, cmask)
                    keys = torch.cat([keys, comp], dim=0)
                    mask = torch.cat([mask, cmask], dim=1)
            logits = torch.einsum("nhd,kd->hnk", q[sl], keys) * hd**-0.5
            logits = logits.masked_fill(~mask[None], float("-inf"))
            sink = self.w[p + "attn_sink"].view(H, 1, 1).expand(H, n, 1)
            comb = torch.cat([logits, sink], dim=-1)
            probs = torch.softmax(comb - comb.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
            out[sl] = torch.einsum("hnk,kd->nhd", probs, keys)
            keep = min(n, W)
            ring[tq[-keep:] % W] = kv[sl][-keep:]
        out = _rope(out, cos[:, None], -sin[:, None])
        g = self.o_groups
        grouped = out.reshape(-1, g, H * hd // g)
        wa = self.w[p + "wo_a.weight"].view(g, -1, H * hd // g)  # [g, o_lora, in]
        mid = torch.einsum("ngi,goi->ngo", grouped, wa).flatten(1)
        return F.linear(mid, self.w[p + "wo_b.weight"])

    def _select(
        self, pool: V4Pool, layer: int, q_res: torch.Tensor, x: torch.Tensor, row: V4Row, tq: torch.Tensor,
        n_ent: int, causal: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The lightning indexer's top-k compressed entries per query, as a [n, n_ent] mask."""
        s = self.spec
        p = f"model.layers.{layer}.attn.indexer."
        key = BufferKey(layer, Kind.CSA_INDEX_K)
        ik = pool.entries(key)[self._entry_rows(pool, key, row, range(0, n_ent))]
        cos, sin = self._cos_sin("compress", tq)
        qi = F.linear(q_res, self.w[p + "wq_b.weight"]).view(-1, s.index_n_heads, s.index_head_dim)
        qi = _rope(qi, cos[:, None], sin[:, None])
        sc = F.relu(torch.einsum("nhd,kd->nhk", qi, ik)) * s.index_head_dim**-0.5
        wts = F.linear(x, self.w[p + "weights_proj.weight"]) * s.index_n_heads**-0.5
        scores = (sc * wts[..., None]).sum(dim=1).masked_fill(~causal, float("-inf"))
        top = scores.topk(min(s.index_topk, n_ent), dim=-1).indices
        sel = torch.zeros_like(causal)
        sel.scatter_(1, top, True)
        return sel & causal

    # ---- step ---------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, rows: Sequence[V4Row], pool: V4Pool, all_logits: bool = False) -> torch.Tensor:
        """Logits of each row's last token ([rows, vocab]), or of every token ([tokens, vocab])."""
        h = self.embed(rows)
        h = self.forward_layers(rows, pool, h, 0, self.spec.num_layers)
        return self.head(rows, h, all_logits)

    # ---- pipeline stages: embed on the first, a layer range on each, head on the last ----------

    def embed(self, rows: Sequence[V4Row]) -> torch.Tensor:
        """The hyper-connection streams entering layer 0: [tokens, hc, hidden]."""
        if not rows:
            raise ValueError("V4 step: no rows")
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64, device=self.device)
        h = self.w["model.embed_tokens.weight"][ids].float()
        return h[:, None, :].expand(-1, self.hc, -1).contiguous()

    @torch.no_grad()
    def forward_layers(
        self, rows: Sequence[V4Row], pool: V4Pool, h: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Run main layers [start, end) on `pool` (which holds at least those layers' keys); returns the streams."""
        if not rows:
            raise ValueError("V4 step: no rows")
        if not 0 <= start < end <= self.spec.num_layers:
            raise ConfigError(f"V4 layer range {start}..{end - 1} is outside the model's 0..{self.spec.num_layers - 1}")
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(r.start, r.start + len(r.token_ids)) for r in rows]).to(self.device)
        h = h.to(self.device)
        for layer in range(start, end):
            p = f"model.layers.{layer}."
            post, comb, collapsed = self._hc(p + "hc_attn", h)
            a = self._attention(pool, layer, self._norm(p + "attn_norm.weight", collapsed), rows, pos)
            h = post[..., None] * a[:, None, :] + torch.matmul(comb.transpose(-1, -2), h)
            post, comb, collapsed = self._hc(p + "hc_ffn", h)
            m = self._moe(layer, self._norm(p + "ffn_norm.weight", collapsed), ids)
            h = post[..., None] * m[:, None, :] + torch.matmul(comb.transpose(-1, -2), h)
        return h

    @torch.no_grad()
    def head(self, rows: Sequence[V4Row], h: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        if not all_logits:
            last = torch.tensor(np.cumsum([len(r.token_ids) for r in rows]) - 1, device=self.device)
            h = h[last]
        flat = _rms(h.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.w["model.hc_head.hc_fn"])
        pre = torch.sigmoid(mixes * self.w["model.hc_head.hc_scale"] + self.w["model.hc_head.hc_base"]) + self.hc_eps
        y = self._norm("model.norm.weight", (pre[..., None] * h).sum(dim=1))
        return F.linear(y, self.w["head.weight"])

    def stage_layout(self, start: int, end: int, page_size: int | None = None) -> V4Layout:
        """The layout of a pipeline stage holding main layers [start, end) (each kind only where read)."""
        return V4Layout(self.spec, start, end, kv_format=ENGINE_FORMAT, index_format=ENGINE_FORMAT, page_size=page_size)


def load_v4(path: str | Path, device: str | torch.device = "cpu") -> DeepseekV4:
    """A V4 checkpoint directory (config.json + *.safetensors) -> DeepseekV4 (fp32)."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg: dict[str, Any] = json.loads((root / "config.json").read_text())
    spec = V4Spec.from_dict(cfg, name=root.name)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {str(root)!r}: write one with `dsakv make-tiny --arch deepseek_v4`")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            weights[k] = v if not v.is_floating_point() else v.float()
    return DeepseekV4(spec, weights, device)
