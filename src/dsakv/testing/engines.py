"""Test support for the engine tests: tiny checkpoints made once per process, transformers references,
and a step driver that checks the pool's books after every scheduler step."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dsakv.engine.engine import Engine
from dsakv.engine.request import RequestOutput, SamplingParams
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import split_options

# Tiny shapes: one thread is faster, and far faster when other processes share the 2 cores
# (multi-threaded kernels on busy cores spin: a 32-token greedy run went from ~25 s to 0.3 s).

ARCHS = ("glm_moe_dsa", "deepseek_v32")
INDEX_TOPK = 16  # of the tiny checkpoints


@functools.cache
def tiny_path(arch: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"dsakv-engine-{arch}-"))
    atexit.register(shutil.rmtree, root, True)
    return make_tiny(root / arch, arch=arch, seed=0)


@functools.cache
def tiny_model(arch: str) -> tuple:
    return load_model(tiny_path(arch))


@functools.cache
def _hf(arch: str):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_path(arch)), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # compared with ignore_eos: the tiny vocab's eos must not stop it
    hf.generation_config.pad_token_id = 0
    return hf


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], steps: int) -> list[int]:
    """transformers' generate(do_sample=False) tokens for one prompt (unbatched)."""
    with torch.no_grad():
        out = _hf(arch).generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)[0]
    return out[len(prompt) :].tolist()


def prompts_for(lengths: Sequence[int], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def flat_engine(model: Any, **kw: Any) -> Engine:
    """Engine(model, engine_config(<kw's flat option names>), <the rest of kw>): the tests' shorthand
    (dsakv.testing.config.OPTIONS); the Engine itself takes only the tree."""
    cfg, rest = split_options(kw)
    return Engine(model, cfg, **rest)


def engine(arch: str = "glm_moe_dsa", **kw: Any) -> Engine:
    """An Engine on the tiny checkpoint of `arch` that checks its books every step; kw as flat_engine."""
    kw.setdefault("check_every_step", True)
    return flat_engine(tiny_model(arch), **kw)


def drive(
    eng: Engine,
    on_step: Callable[[int, list[RequestOutput]], None] | None = None,
    max_steps: int = 10_000,
) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished, checking integrity after every step; final output per request."""
    final: dict[str, RequestOutput] = {}
    for i in range(max_steps):
        if not eng.has_unfinished():
            break
        outs = eng.step()
        eng.check_integrity()
        for o in outs:
            if o.finished:
                final[o.request_id] = o
        if on_step is not None:
            on_step(i, outs)
            eng.check_integrity()
    else:
        raise AssertionError(f"engine did not finish in {max_steps} steps")
    eng.check_integrity()
    st = eng.stats()
    assert st.pages_used == 0 and st.num_running == 0 and st.num_waiting == 0
    return final


def greedy_params(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def fitted_mtp_tiny(root: Path) -> Path:
    """The MTP tests' checkpoint: the 12-layer tiny glm_moe_dsa model (seed 0) with one MTP layer fitted on
    fit_prompts(512, 16), so drafts are accepted there and rarely elsewhere; written under `root`."""
    from dsakv.engine.mtp_fit import fit_mtp

    path = make_tiny(root / "tiny", seed=0, mtp=1)
    fit_mtp(path, num_prompts=16, steps=60)
    return path


def mtp_prompts(fitted: int, fresh: Sequence[int], seed: int) -> list[list[int]]:
    """The first `fitted` prompts the MTP layer was fitted on, then random prompts of the `fresh` lengths (a
    generator seeded `seed`)."""
    from dsakv.engine.mtp_fit import fit_prompts

    g = torch.Generator().manual_seed(seed)
    return fit_prompts(512, 16)[:fitted] + [torch.randint(2, 512, (n,), generator=g).tolist() for n in fresh]
