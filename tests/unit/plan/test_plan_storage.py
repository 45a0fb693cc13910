"""Planner: L3 storage size in tokens (--hicache-storage-size), index-K only for producers in storage too."""

from __future__ import annotations

import json

import pytest

from dsakv.cache.storage.base import META
from dsakv.cli.main import main
from dsakv.errors import CapacityError
from dsakv.plan import Deployment, parse_size, plan
from dsakv.plan.capacity import STORAGE_RECORD_BYTES
from dsakv.spec import load_spec


def test_record_bytes_match_the_storage_record() -> None:
    assert STORAGE_RECORD_BYTES == META.size == 144


def test_glm52_one_tib_of_storage() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, role="decode", kv_budget=parse_size("96.33GiB"), hicache_storage_size=2**40))
    (s,) = rp.stages
    assert (s.bytes_per_token_dense, s.bytes_per_token_elided) == (61_464, 53_940)
    # floor(2^40 / (B/token x 64 + 144)) pages x 64 tokens
    assert s.storage_tokens_dense == 279_500 * 64 == 17_888_000
    assert s.storage_tokens_elided == 318_486 * 64 == 20_383_104
    assert s.storage_bytes == 2**40
    assert s.to_dict()["storage_tokens_elided"] == 20_383_104


def test_pp_stage_storage_per_stage_layout() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(
        Deployment(spec, role="prefill", partition=(20, 20, 20, 18), kv_budget=98 * 2**30, hicache_storage_size=2**36)
    )
    assert len(rp.stages) == 4
    for s in rp.stages:
        per_page = s.bytes_per_token_elided * 64 + STORAGE_RECORD_BYTES
        assert s.storage_tokens_elided == (2**36 // per_page) * 64


def test_storage_too_small_names_the_flag() -> None:
    spec = load_spec("glm-5.2")
    with pytest.raises(CapacityError, match=r"--hicache-storage-size 1000 B holds no page \(3933840 B per stored"):
        plan(Deployment(spec, kv_budget=2**34, hicache_storage_size=1000))


def test_cli_json_and_table(capsys) -> None:
    assert main(["plan", "glm-5.2", "--kv-budget", "96.33GiB", "--hicache-storage-size", "1TiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stage = out["stages"][0] if "stages" in out else out["roles"][0]["stages"][0]
    assert stage["storage_tokens_elided"] == 20_383_104
    assert main(["plan", "glm-5.2", "--kv-budget", "96.33GiB", "--hicache-storage-size", "1TiB"]) == 0
    assert "20,383,104" in capsys.readouterr().out
