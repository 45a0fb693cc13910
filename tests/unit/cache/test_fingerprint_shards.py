"""The weights fingerprint of a rank's shard: each TP / EP shard of a checkpoint gets the fingerprint of its own
tensors, never the one another shard (or the whole model) stored first under the same checkpoint identity."""

from __future__ import annotations

import pytest

from dsakv.cache import fingerprint
from dsakv.cache.fingerprint import SHARD, VARIANT, tensors_digest, weights_fingerprint
from dsakv.model.loader import load_model
from dsakv.model.parallel import TPGroup, attach_ep, load_tp_model
from dsakv.testing.engines import tiny_path

ARCH = "glm_moe_dsa"


def test_every_shard_its_own_fingerprint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_memo", {})
    root = tiny_path(ARCH)
    models = {
        "tp 1/2": load_tp_model(root, TPGroup(1, 2))[1],  # first: its value must not become the others'
        "tp 0/2": load_tp_model(root, TPGroup(0, 2))[1],
        "": load_model(root)[1],
        "ep 1/2": attach_ep(load_model(root)[1], 1, 2),
        "ep 0/2": attach_ep(load_model(root)[1], 0, 2),
    }
    got = {}
    for shard, model in models.items():
        assert getattr(model, SHARD, "") == shard
        got[shard] = weights_fingerprint(model, root)
        assert got[shard] == tensors_digest(model)[:16], shard
    assert len(set(got.values())) == 5  # every shard differs from the others and from the whole model
    # cached per shard: a restart (empty in-process memo, the disk cache kept) gets each shard's own value back
    monkeypatch.setattr(fingerprint, "_memo", {})
    for shard in ("ep 0/2", "", "tp 0/2", "tp 1/2", "ep 1/2"):
        assert weights_fingerprint(models[shard], root) == got[shard], shard
    assert len(fingerprint._load_disk_cache()) == 5


def test_quantised_on_load_its_own_fingerprint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same files loaded as read, as int8 and as fp8 are three models (other KV): each its own fingerprint,
    never the one the first load cached under the files' identity."""
    monkeypatch.setenv("DSAKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fingerprint, "_memo", {})
    root = tiny_path(ARCH)
    got = {}
    for wd in ("model", "int8", "fp8"):  # the plain model first: its cached value must not become the others'
        model = load_model(root, weight_dtype=wd)[1]
        assert getattr(model, VARIANT, "") == ("" if wd == "model" else wd)
        got[wd] = weights_fingerprint(model, root)
        assert got[wd] == tensors_digest(model)[:16], wd
    assert len(set(got.values())) == 3
    assert len(fingerprint._load_disk_cache()) == 3
