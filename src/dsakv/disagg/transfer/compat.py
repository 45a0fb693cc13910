"""Handshake compatibility check: pair a sender's buffers with a receiver's, by key.

Run once per peer at handshake, before any request. Buffers pair by
BufferKey, so a PP stage holding layers 20-39 pairs with a decode worker
holding 0-77 (+ draft) with no span to align:

    sender  (prefill PP1, layers 20-39)       receiver (decode, layers 0-77 +78)
    L20/kv ─────────────────────────────────► L20/kv
    L22/kv ─────────────────────────────────► L22/kv
    L22/index_k ────────────────────────────► L22/index_k      (22 is a producer)
    L21/index_k  (elision off on the sender)   -                 skipped: one-sided, shared layer
    -                                          L0/kv ... L19/kv  not the sender's layers: not paired

Rules, checked in this order (the first failing group raises IncompatiblePeer):
- same model identity hash, page size and main-layer count;
- at least one layer in common;
- (check_draft, at the handshake) the prefill's last stage holds exactly the decode's draft (MTP) layers;
- for every key of a common layer: held by both with the same bytes per page and
  the same format; a key held by one side only is skipped when it is the INDEX_K
  of a shared layer (one-sided elision), and refused otherwise.
Every message names the layer, the kind and both values.
Imports spec and disagg.manifest only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dsakv.disagg.protocol.errors import IncompatiblePeer
from dsakv.disagg.transfer.manifest import Manifest, RegionInfo
from dsakv.spec.layout import MLA_KINDS, BufferKey, Kind

log = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 5


@dataclass(frozen=True)
class KeyPair:
    """One buffer on both sides: bytes flow from `src` (sender) to `dst` (receiver) page by page."""

    key: BufferKey
    src: RegionInfo
    dst: RegionInfo

    def __post_init__(self) -> None:
        if self.src.page_bytes != self.dst.page_bytes:
            raise IncompatiblePeer(
                f"{self.key} (layer {self.key.layer}, kind {self.key.kind.value}): sender {self.src.page_bytes} "
                f"B/page != receiver {self.dst.page_bytes} B/page"
            )

    @property
    def page_bytes(self) -> int:
        return self.src.page_bytes


@dataclass(frozen=True)
class SkippedKey:
    """A key held by one side only that is legitimately not transferred (one-sided index-K elision)."""

    key: BufferKey
    held_by: str  # "sender" or "receiver"
    reason: str


@dataclass(frozen=True)
class Pairing:
    """The outcome of a successful handshake check."""

    sender: str
    receiver: str
    layers: tuple[int, ...]
    pairs: tuple[KeyPair, ...]
    skipped: tuple[SkippedKey, ...]

    @property
    def bytes_per_page(self) -> int:
        """Bytes moved per transferred page (sum over paired keys)."""
        return sum(p.page_bytes for p in self.pairs)

    def bytes_by_kind(self) -> dict[Kind, int]:
        out = {k: 0 for k in MLA_KINDS}
        for p in self.pairs:
            out[p.key.kind] += p.page_bytes
        return out


def _refuse(sender: Manifest, receiver: Manifest, problems: list[str]) -> IncompatiblePeer:
    head = f"incompatible peers: sender {sender.worker!r} -> receiver {receiver.worker!r}: "
    listed = "; ".join(problems[:MAX_LISTED_PROBLEMS])
    more = f" (and {len(problems) - MAX_LISTED_PROBLEMS} more)" if len(problems) > MAX_LISTED_PROBLEMS else ""
    return IncompatiblePeer(head + listed + more)


def _check_model(sender: Manifest, receiver: Manifest) -> list[str]:
    problems = []
    if sender.model_hash != receiver.model_hash:
        problems.append(
            f"model identity differs: sender runs {sender.model_name!r} #{sender.model_hash}, receiver runs "
            f"{receiver.model_name!r} #{receiver.model_hash}; both peers must load the same model config"
        )
    if sender.num_main_layers != receiver.num_main_layers or sender.shared_layers != receiver.shared_layers:
        problems.append(
            f"layer ownership differs: sender has {sender.num_main_layers} layers with {len(sender.shared_layers)} "
            f"shared, receiver has {receiver.num_main_layers} with {len(receiver.shared_layers)} shared"
        )
    if sender.page_size != receiver.page_size:
        problems.append(
            f"page size differs: sender {sender.page_size} tokens/page, receiver {receiver.page_size} tokens/page; "
            "start both with the same --page-size"
        )
    return problems


def _describe_key(key: BufferKey) -> str:
    return f"{key} (layer {key.layer}, kind {key.kind.value})"


def check_pair(sender: Manifest, receiver: Manifest) -> Pairing:
    """Pair every buffer of the layers both peers hold; raise IncompatiblePeer naming what differs."""
    problems = _check_model(sender, receiver)
    if problems:
        raise _refuse(sender, receiver, problems)
    common = tuple(layer for layer in sender.layers if receiver.holds_layer(layer))
    if not common:
        raise _refuse(
            sender,
            receiver,
            [
                f"no layer in common: sender holds layers {sender.describe_layers()}, receiver holds "
                f"{receiver.describe_layers()}"
            ],
        )
    common_set = frozenset(common)
    shared = frozenset(sender.shared_layers)
    keys = sorted({k for k in (*sender.keys, *receiver.keys) if k.layer in common_set})
    pairs: list[KeyPair] = []
    skipped: list[SkippedKey] = []
    for key in keys:
        s, r = sender.regions.get(key), receiver.regions.get(key)
        if s is not None and r is not None:
            sf, rf = sender.format_of(key.kind), receiver.format_of(key.kind)
            if sf != rf:
                problems.append(
                    f"{_describe_key(key)}: format differs, sender {sf} ({s.page_bytes} B/page) vs receiver "
                    f"{rf} ({r.page_bytes} B/page); use the same --{key.kind.value.replace('_', '-')}-format"
                )
            elif s.page_bytes != r.page_bytes:
                problems.append(
                    f"{_describe_key(key)}: size differs, sender {s.page_bytes} B/page vs receiver "
                    f"{r.page_bytes} B/page"
                )
            else:
                pairs.append(KeyPair(key, s, r))
            continue
        side, other, reg = ("sender", "receiver", s) if s is not None else ("receiver", "sender", r)
        assert reg is not None
        if key.kind is Kind.INDEX_K and key.layer in shared:
            skipped.append(
                SkippedKey(
                    key,
                    side,
                    f"layer {key.layer} is shared: its index-K is never read; the {other} elides it",
                )
            )
            continue
        problems.append(
            f"{_describe_key(key)}: held by the {side} ({reg.page_bytes} B/page) but not by the {other} "
            f"(0 B/page); only the index-K of a shared layer may be held by one side"
        )
    if problems:
        raise _refuse(sender, receiver, problems)
    if not pairs:  # pragma: no cover - every common layer has a KV on both sides once the checks pass
        raise _refuse(sender, receiver, ["no buffer in common"])
    if skipped:
        log.info(
            "%s -> %s: %d one-sided index-K buffer(s) skipped (shared layers): %s",
            sender.worker,
            receiver.worker,
            len(skipped),
            ", ".join(str(s.key) for s in skipped[:8]),
        )
    return Pairing(sender.worker, receiver.worker, common, tuple(pairs), tuple(skipped))


def check_draft(sender: Manifest, receiver: Manifest, stage: int, num_stages: int) -> None:
    """MTP in PD: the prefill's last stage (the one with the final hidden states) holds exactly the decode's draft
    layers and sends their KV / INDEX_K; earlier stages hold none. Raise IncompatiblePeer saying what to change."""
    mine, theirs = tuple(sender.draft_layers), tuple(receiver.draft_layers)
    last = stage == num_stages - 1
    where = f"prefill {sender.worker!r} (stage {stage} of {num_stages})"
    if not last:
        if mine:
            raise IncompatiblePeer(
                f"{where} holds draft layer(s) {list(mine)}, but only the last stage runs the MTP layer: start every "
                "stage with the same --speculative-num-steps and --pp-size"
            )
        return
    if mine == theirs:
        return
    if not mine:
        raise IncompatiblePeer(
            f"decode {receiver.worker!r} speculates (draft layer(s) {list(theirs)}: --speculative-num-steps) but "
            f"{where} sends no draft-layer KV: start the prefill with --speculative-num-steps K as well (its last "
            "stage then computes the draft layer's KV for the prompt), or the decode without it"
        )
    if not theirs:
        raise IncompatiblePeer(
            f"{where} sends draft layer(s) {list(mine)} (--speculative-num-steps) but decode {receiver.worker!r} "
            "does not speculate: start the decode with --speculative-num-steps K as well, or the prefill without it"
        )
    raise IncompatiblePeer(
        f"{where} holds draft layer(s) {list(mine)} but decode {receiver.worker!r} holds {list(theirs)}: both "
        "must run the same number of MTP layers"
    )


def pair(sender: Manifest, receiver: Manifest) -> list[KeyPair]:
    """The key pairs a sender transfers to a receiver (see check_pair for the rules and the errors)."""
    return list(check_pair(sender, receiver).pairs)
