"""DeepSeek-V4 on dsakv's V4 pool == transformers' DeepseekV4ForCausalLM (tokens, logits within 1e-4, fp32).

Both tiny layer patterns (flash: 2 window-only layers first; pro: 2 HCA layers first), 6 prompts each up to
5x the window (8) and 3 HCA groups (16 tokens each), prefilled in chunks and batched with decodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsakv.cache.v4_pool import V4Pool
from dsakv.cli.main import main
from dsakv.engine.v4_engine import V4Engine
from dsakv.model.deepseek_v4 import DeepseekV4, load_v4
from dsakv.model.deepseek_v4_tiny import make_tiny_v4
from dsakv.plan.v4 import V4Deployment, plan_v4
from dsakv.spec.layout import BufferKey, Kind
from dsakv.spec.v4 import CSA, HCA, WINDOW
from dsakv.spec.v4_layout import PAGED_KINDS, STATE_KINDS

NEW = 10
LENGTHS = (1, 5, 9, 17, 24, 40)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4")
    return {p: make_tiny_v4(root / p, p) for p in ("flash", "pro")}


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """transformers' greedy continuation and its logits, per pattern and prompt."""
    from transformers import AutoModelForCausalLM

    out = {}
    for pattern, path in ckpts.items():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        rows = []
        for p in _prompts():
            r = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            rows.append((r.sequences[0, len(p) :].tolist(), torch.cat(r.logits)))
        out[pattern] = rows
    return out


@pytest.mark.parametrize("pattern", ["flash", "pro"])
def test_tokens_and_logits_match_transformers(ckpts, reference, pattern: str) -> None:
    model = load_v4(ckpts[pattern])
    types = model.spec.layer_types
    assert types[:2] == ((WINDOW, WINDOW) if pattern == "flash" else (HCA, HCA)) and CSA in types
    eng = V4Engine(model, num_pages=64, max_running=4, chunk_size=7, max_batch_tokens=20, keep_logits=True)
    outs = eng.generate(_prompts(), NEW)
    assert eng.steps < sum(LENGTHS) // 7 + NEW * len(LENGTHS)  # rows of several requests share steps
    for out, (ref_tokens, ref_logits) in zip(outs, reference[pattern], strict=True):
        assert out.output == ref_tokens
        diff = (torch.stack(out.logits) - ref_logits).abs().max().item()
        assert diff < 1e-4, diff
    assert eng.pages.num_free == 64 and eng.slots.num_free == 4


def test_chunking_and_batching_do_not_change_tokens(ckpts, reference) -> None:
    model = load_v4(ckpts["flash"])
    want = [t for t, _ in reference["flash"]]
    whole = V4Engine(model, num_pages=64, max_running=1, chunk_size=64, max_batch_tokens=64)
    assert [r.output for r in whole.generate(_prompts(), NEW)] == want
    tiny = V4Engine(model, num_pages=64, max_running=6, chunk_size=3, max_batch_tokens=9)
    assert [r.output for r in tiny.generate(_prompts(), NEW)] == want


@pytest.mark.parametrize("pattern", ["flash", "pro"])
def test_pool_bytes_equal_planner_bytes_per_kind(ckpts, pattern: str) -> None:
    model = load_v4(ckpts[pattern])
    spec = model.spec
    d = V4Deployment(spec, kv_format="fp32", index_format="fp32", kv_budget=10_000_000, max_running=3)
    sp = plan_v4(d).stages[0]
    assert sp.pages is not None and sp.tokens == sp.pages * 16
    lay = sp.layout
    pool = V4Pool(lay, sp.pages, sp.slots)
    assert pool.nbytes == lay.pool_bytes(sp.pages, 3) == sp.pages * lay.bytes_per_page + sp.state_bytes <= 10_000_000
    n_csa, n_hca = len(spec.layers_of(CSA)), len(spec.layers_of(HCA))
    per_token = {Kind.CSA_KV: n_csa * 128 // 4, Kind.CSA_INDEX_K: n_csa * 64 // 4, Kind.HCA_KV: n_hca * 128 // 16}
    per_request = {
        Kind.WINDOW: 6 * 8 * 128,
        Kind.CSA_STATE: n_csa * 8 * 4 * 32 * 4,
        Kind.CSA_INDEX_STATE: n_csa * 8 * 4 * 16 * 4,
        Kind.HCA_STATE: n_hca * 3 * 32 * 4,
    }
    for kind in PAGED_KINDS:
        got = sum(pool.nbytes_of(k) for k in lay.keys if k.kind is kind)
        assert got == lay.bytes_per_token_of(kind) * sp.tokens == per_token[kind] * sp.tokens
    for kind in STATE_KINDS:
        got = sum(pool.nbytes_of(k) for k in lay.keys if k.kind is kind)
        assert got == lay.state_bytes_of(kind) * 3 == per_request[kind] * 3
    assert model.layout(16).by_key == lay.by_key


def test_keys_not_read_do_not_exist(ckpts) -> None:
    model: DeepseekV4 = load_v4(ckpts["flash"])
    pool = V4Pool(model.layout(), 4, 1)
    with pytest.raises(KeyError, match="layer 0 is a sliding_attention layer: it reads only window"):
        pool.paged(BufferKey(0, Kind.CSA_KV))
    with pytest.raises(KeyError, match="it reads only hca_kv, window, hca_state"):
        pool.state(BufferKey(3, Kind.CSA_STATE))
    assert pool.has(BufferKey(2, Kind.CSA_INDEX_K)) and not pool.has(BufferKey(3, Kind.CSA_INDEX_K))


def test_make_tiny_cli(tmp_path, capsys) -> None:
    assert main(["make-tiny", str(tmp_path / "m"), "--arch", "deepseek_v4", "--layer-pattern", "pro"]) == 0
    out = capsys.readouterr().out
    assert "6 layers = 0 window-only + 2 CSA (ratio 4) + 4 HCA (ratio 16), window 8" in out
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_prefix_hit_equals_no_hit(ckpts) -> None:
    """A hit shares the prompt's full pages (every paged kind) and restores the stored boundary state."""
    model = load_v4(ckpts["pro"])
    g = torch.Generator().manual_seed(5)
    base = torch.randint(2, 500, (40,), generator=g).tolist()
    tails = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3, 9, 1)]
    first = [base]  # cached: its boundary is token 32 (2 pages of 16)
    then = [base[:33] + tails[0], base[:20] + tails[1], base + tails[2], base[:16]]
    plain = V4Engine(model, num_pages=64, max_running=4, chunk_size=7, max_batch_tokens=20)
    want = [r.output for r in plain.generate(first + then, NEW)]
    eng = V4Engine(model, num_pages=64, max_running=4, chunk_size=7, max_batch_tokens=20, prefix_cache=True)
    got = [r.output for r in eng.generate(first, NEW)]
    assert eng.stats.snapshots == 1 and eng.cached_tokens() == 32
    assert eng.stats.snapshot_bytes == eng.layout.state_bytes_per_request
    got += [r.output for r in eng.generate(then, NEW)]
    assert got == want
    # base[:33]+t and base+t hit the stored 32-token boundary; base[:20]+t misses (no state is stored at 16: it
    # stores its own); base[:16] has no full page before its last token, so it does not look up
    assert eng.stats.hits == 2 and eng.stats.hit_tokens == 64
    assert eng.recompute_tokens(32) == 32 and eng.recompute_tokens(4096) == 6 * 8
    eng.check_integrity()
    assert eng.pages.num_free == 64 - len({int(p) for ids, _ in eng._cache.values() for p in ids})


def test_host_tier_on_equals_off(ckpts) -> None:
    """A prefix evicted from a small device pool goes to the host tier (same layout) and hits there."""
    model = load_v4(ckpts["flash"])
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(2, 500, (40,), generator=g).tolist() for _ in range(2))
    c = a[:33] + torch.randint(2, 500, (4,), generator=g).tolist()
    plain = V4Engine(model, num_pages=16, max_running=1, chunk_size=7, max_batch_tokens=20)
    want = [r.output for r in plain.generate([a, b, c], NEW)]
    got: dict[bool, list[list[int]]] = {}
    for host in (False, True):
        eng = V4Engine(model, num_pages=5, max_running=1, chunk_size=7, max_batch_tokens=20, prefix_cache=True,
                       host_pages=8 if host else 0)  # fmt: skip
        got[host] = [r.output for p in (a, b, c) for r in eng.generate([p], NEW)]
        assert eng.stats.evicted >= 1  # b's 4 pages need a's cached 2
        assert eng.stats.host_hits == (1 if host else 0)
        assert eng.stats.host_hit_tokens == (32 if host else 0) and eng.stats.hits == 0
        eng.check_integrity()
        if host:
            assert eng.host is not None and eng.host.nbytes == eng.layout.pool_bytes(8, 1)
            assert set(eng.host._paged) == {s.key for s in eng.layout.paged}  # each kind only where read
    assert got[False] == got[True] == want


def test_generate_cli_runs_v4(ckpts, reference, capsys) -> None:
    prompt = _prompts()[3]
    argv = ["generate", "--model", str(ckpts["flash"]), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(NEW), "--page-size", "16", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["output_ids"] == reference["flash"][3][0] and rows[0]["finish_reason"] == "length"
    sampled = [*argv, "--temperature", "0.7", "--seed", "4"]
    assert main(sampled) == 0 and main(sampled) == 0
    first, second = (json.loads(line)[0]["output_ids"] for line in capsys.readouterr().out.splitlines())
    assert first == second and len(first) == NEW  # --seed: the same draw


def test_pd_prefill_to_decode_equals_colocated(ckpts, reference) -> None:
    """A prefill engine sends every kind of its pages and the request's state (paired by key) to a decode engine."""
    from dsakv.engine.v4_transfer import prefill_request, transfer_request
    from dsakv.errors import ConfigError

    model = load_v4(ckpts["pro"])
    pre = V4Engine(model, num_pages=64, max_running=2, chunk_size=7, max_batch_tokens=20)
    dec = V4Engine(model, num_pages=64, max_running=6)
    ids, moved = [], []
    for p in _prompts():
        rid, nbytes = transfer_request(pre, prefill_request(pre, p), dec, NEW)
        ids.append(rid)
        moved.append(nbytes)
        pre.check_integrity()
    while dec.has_unfinished():
        dec.step()
    assert [dec.finished[i].output for i in ids] == [t for t, _ in reference["pro"]]
    lay = dec.layout
    assert moved == [-(-n // 16) * lay.bytes_per_page + lay.state_bytes_per_request for n in LENGTHS]
    assert pre.pages.num_free == 64 and pre.slots.num_free == 2 and not pre.parked
    other = V4Engine(model, num_pages=64, max_running=1, page_size=32)
    req = prefill_request(pre, _prompts()[2])
    with pytest.raises(ConfigError, match=r"csa_kv\): sender 4 x 128 B per page \(page 16"):
        transfer_request(pre, req, other, NEW)
    assert pre.parked  # refused: nothing was freed or sent
