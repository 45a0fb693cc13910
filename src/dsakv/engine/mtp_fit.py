"""fit_mtp: fit a tiny checkpoint's MTP layer to the model's own greedy continuations (make-tiny --fit-mtp).

A random MTP layer almost never agrees with its target, so speculative decoding would accept nothing.
This trains it the way MTP layers are trained, on the target's own outputs: sequences are random prompts
followed by the target's greedy continuation (the dsakv engine), the target's final normed hidden states come
from transformers' model, and the draft layer (built from transformers' decoder layer class, so it has
gradients) learns entry i = (hidden i, token i+1) -> token i+2 with cross-entropy over the continuation.
Deterministic (seeded data, seeded init, one thread, fixed step count) and short on a CPU (~10-30 s).
Imports torch, transformers (lazily) and dsakv.{model,engine}.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dsakv.errors import ConfigError

log = logging.getLogger(__name__)


def _hf_block_names(draft_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dsakv MTPDraft layer-0 tensors -> transformers names of (eh_proj, enorm, hnorm, post_norm, block.*)."""
    out: dict[str, torch.Tensor] = {}
    per: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in draft_sd.items():
        if not name.startswith("layers.0."):
            continue
        rest = name.removeprefix("layers.0.")
        if rest.startswith("shared_head.norm."):
            out["post_norm." + rest.removeprefix("shared_head.norm.")] = t
        elif rest.startswith("block.mlp.experts."):
            e, proj = rest.removeprefix("block.mlp.experts.").split(".")[:2]
            per.setdefault(int(e), {})[proj] = t
        else:
            out[rest] = t
    if per:
        order = sorted(per)
        out["block.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order]
        )
        out["block.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    return out


def _dsakv_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of _hf_block_names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_sd.items():
        if name.startswith("post_norm."):
            out["layers.0.shared_head.norm." + name.removeprefix("post_norm.")] = t
        elif name == "block.mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"layers.0.block.mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"layers.0.block.mlp.experts.{e}.up_proj.weight"] = up
        elif name == "block.mlp.experts.down_proj":
            for e, w in enumerate(t):
                out[f"layers.0.block.mlp.experts.{e}.down_proj.weight"] = w
        else:
            out["layers.0." + name] = t
    return out


class _TrainableMTP(torch.nn.Module):
    """The MTP layer over transformers' own decoder layer class (differentiable, dense causal mask)."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        cfg = copy.deepcopy(hf.config)
        n = cfg.num_hidden_layers
        layer_cls = type(hf.model.layers[-1])
        norm_cls = type(hf.model.norm)
        sparse = "sparse" if getattr(cfg, "n_routed_experts", 0) else "dense"
        if getattr(cfg, "mlp_layer_types", None) is not None:
            cfg.mlp_layer_types = [sparse] * n
        if getattr(cfg, "indexer_types", None) is not None:
            cfg.indexer_types = ["full"] * n
        cfg.first_k_dense_replace = 0
        h = cfg.hidden_size
        self.enorm = norm_cls(h, eps=cfg.rms_norm_eps)
        self.hnorm = norm_cls(h, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = layer_cls(cfg, 0)
        self.post_norm = norm_cls(h, eps=cfg.rms_norm_eps)

    def forward(self, hf: Any, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [1, m] (tokens 1..m), hidden [1, m, H] (target hidden 0..m-1) -> logits [1, m, vocab]."""
        m = next_ids.shape[1]
        emb = hf.model.embed_tokens(next_ids)
        pos = torch.arange(1, m + 1)[None]
        mask = torch.ones(m, m, dtype=torch.bool).tril()[None, None]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        out = self.block(
            x,
            attention_mask=mask,
            position_embeddings=hf.model.rotary_emb(emb, position_ids=pos),
            position_ids=pos,
            cache=None,
        )
        x = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(self.post_norm(x))


FIT_PROMPT_LEN = 8
FIT_NEW_TOKENS = 32


def fit_prompts(
    vocab_size: int, num_prompts: int = 32, seed: int = 0, prompt_len: int = FIT_PROMPT_LEN
) -> list[list[int]]:
    """The seeded prompts --fit-mtp fits on (bench/mtp.py and the demo decode these)."""
    gen = torch.Generator().manual_seed(seed + 104729)
    return [torch.randint(2, vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]


def fit_mtp(
    ckpt: str | Path,
    *,
    num_prompts: int = 32,
    new_tokens: int = FIT_NEW_TOKENS,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict[str, float]:
    """Fit the MTP layer of checkpoint `ckpt` (make-tiny --mtp 1) in place; returns the fit's figures.

    The tiny model is random, so its greedy continuations are close to unpredictable from outside (a bigram
    table agrees ~12% of the time): the fit learns the continuations of the seeded fit_prompts() set, on
    which acceptance is then high, and reports the agreement on fresh prompts (low) next to it.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and fast at this size (more threads only contend)
    try:
        return _fit(Path(ckpt), num_prompts, new_tokens, steps, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _fit(root: Path, num_prompts: int, new_tokens: int, steps: int, lr: float, seed: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from dsakv.config import EngineConfig, LayoutConfig, PoolConfig, SchedulerConfig
    from dsakv.engine.engine import Engine
    from dsakv.engine.request import SamplingParams
    from dsakv.model.loader import load_draft, load_model
    from dsakv.model.tiny import write_mtp_layers

    t_start = time.perf_counter()
    spec, model = load_model(root)
    if spec.num_draft_layers < 1:
        raise ConfigError(f"--fit-mtp: {str(root)!r} has no MTP layer: add --mtp 1")
    draft = load_draft(root)
    fresh = 16
    prompts = fit_prompts(spec.vocab_size, num_prompts + fresh, seed)  # the last `fresh` are held out
    cfg = EngineConfig(
        layout=LayoutConfig(page_size=16),
        pool=PoolConfig(max_tokens=len(prompts) * (FIT_PROMPT_LEN + new_tokens + 16)),
        scheduler=SchedulerConfig(max_batch_tokens=4096, max_running_requests=len(prompts)),
    )
    eng = Engine((spec, model), cfg)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    seqs = torch.tensor([p + o for p, o in zip(prompts, outs, strict=True)])
    hf = AutoModelForCausalLM.from_pretrained(str(root)).float().eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        o = hf(seqs, output_hidden_states=True)
        hidden, labels = o.hidden_states[-1], o.logits.argmax(-1)  # labels[:, j]: the target's token after j
    net = _TrainableMTP(hf)
    missing, unexpected = net.load_state_dict(_hf_block_names(draft.state_dict()), strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"--fit-mtp: draft tensors do not map onto the trainable layer: {missing[:4]} {unexpected[:4]}"
        )
    params = [p for p in net.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    m = seqs.shape[1] - 1  # entry i = (hidden i, token i+1) -> the target's token after i+1

    def logits_of(ix: torch.Tensor) -> torch.Tensor:
        return net(hf, seqs[ix, 1:], hidden[ix, :m])

    def agree(ix: torch.Tensor) -> float:
        with torch.no_grad():
            pred = logits_of(ix).argmax(-1)[:, FIT_PROMPT_LEN - 1 :]
            return float((pred == labels[ix, 1:][:, FIT_PROMPT_LEN - 1 :]).float().mean())

    train = torch.arange(num_prompts)
    held = torch.arange(num_prompts, num_prompts + fresh)
    before = agree(train)
    net.train()
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        lg = logits_of(train)
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[train, 1:].reshape(-1))
        loss.backward()
        opt.step()
    net.eval()
    after, fresh_agree = agree(train), agree(held)
    sd = draft.state_dict()
    sd.update(_dsakv_names({k: v.detach() for k, v in net.state_dict().items()}))
    draft.load_state_dict(sd)
    write_mtp_layers(root, draft)
    secs = time.perf_counter() - t_start
    log.info(
        "fit the MTP layer of %s in %.1f s (%d steps): agreement on the fit prompts %.3f -> %.3f, fresh prompts %.3f",
        root,
        secs,
        steps,
        before,
        after,
        fresh_agree,
    )
    return {
        "agreement_before": round(before, 4),
        "agreement_after": round(after, 4),
        "agreement_fresh": round(fresh_agree, 4),
        "final_loss": round(float(loss.detach()), 4),
        "seconds": round(secs, 1),
    }
