"""Bootstrap handshake between a prefill stage (sender) and a decode worker (receiver), over the control RPC.

    stage k ── rpc HANDSHAKE Hello(prefill, stage, num_stages, rpc, manifest) ──► decode
            ◄── HelloReply(manifest (decode's), boot, name) ─────────────────────
    both sides run compat.check_draft (MTP: the last stage holds exactly the decode's draft layers, earlier
    stages none) and compat.check_pair(stage manifest, decode manifest): buffers pair by BufferKey, a key held
    by one side only is skipped only if it is the INDEX_K of a shared layer; anything else is refused with
    IncompatiblePeer naming layer, kind and both sizes (the stage's connect fails loudly).
    stage k then connects its TransferBackend to the decode's (backend meta in the manifest) and keeps a
    DecodeLink (peer + PairTable) per decode address, keyed by the decode's boot id: a restarted decode
    (new boot id) is handshaken again on the next request. A TP decode's reply lists its ranks 1.. (HelloReply.
    ranks, each rank's pool and backend endpoint in its manifest; a TP x PP decode: every stage's ranks): one part
    per (decode stage, rank) sharing layers with this stage (rank_routes picks the keys this prefill rank writes
    into each); its `cell` (stage x TP + rank) keys the bytes STAGE_DONE reports per part.

The decode side keeps a StageRegistry: which stages of which prefill worker have handshaken (their boot id,
RPC address, layer range, what was skipped), so it can check a request's prefill is complete, ping the stages a
request still waits for, and accept a stage's reports only from the process (boot id) that registered. A hello
is checked before it is registered (stage < num_stages, an RPC host:port, the manifest's layers where stage 0 /
the last stage must start / end). A registration is replaced only by its owner repeating exactly what it
registered (same boot, manifest, address, stage count: anything else under its boot is refused), or by another
process once the registered one is proven gone (nothing listens at its address, or another boot answers there);
one that does not answer its ping (stalled, e.g. SIGSTOP) may resume, so it keeps its registration and the new
handshake is refused (the stage retries it on its next request). The reply carries the decode's page-grant key
(grants.py).

Imports disagg.{rpc, messages, manifest, compat, transfer_plan, backends.base, errors}; never engine or torch.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from dsakv.disagg.protocol.errors import Forbidden, IncompatiblePeer, MessageError
from dsakv.disagg.protocol.messages import HANDSHAKE, PING, Hello, HelloReply, LinkSummary, Ping
from dsakv.disagg.protocol.rpc import PeerUnavailable, RpcClient, RpcError, split_addr
from dsakv.disagg.transfer.backends.base import Peer, TransferBackend
from dsakv.disagg.transfer.compat import Pairing, check_draft, check_pair
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.plan import PairTable
from dsakv.disagg.transfer.rank_assign import RankId, RoleGrid, check_announced, check_grids
from dsakv.errors import ConfigError
from dsakv.spec.layout import BufferKey, Kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkPart:
    """One decode stage (and TP rank: its own pool) this prefill stage shares layers with: its keys paired, its
    engine connected."""

    stage: int
    manifest: Manifest
    pairing: Pairing
    table: PairTable
    peer: Peer
    rank: int = 0  # the decode TP rank whose pool this is (HelloReply.ranks: rank r >= 1 holds rank 0's keys)
    cell: int = 0  # its flat rank in the decode's grid, stage x TP + rank (0 for a TP-1 decode): STAGE_DONE's key


@dataclass(frozen=True)
class DecodeLink:
    """A handshaken decode worker, as one prefill stage sees it: one part per decode stage holding some of this
    stage's layers (a single-stage decode: one part, stage 0)."""

    addr: str
    boot: str
    manifest: Manifest
    parts: tuple[LinkPart, ...]
    grant_key: bytes = b""  # verifies the decode's page grants (HelloReply.grant_key)

    @property
    def pairing(self) -> Pairing:
        return self.parts[0].pairing

    @property
    def table(self) -> PairTable:
        return self.parts[0].table

    @property
    def peer(self) -> Peer:
        return self.parts[0].peer

    def summary(self) -> LinkSummary:
        return LinkSummary(
            addr=self.addr,
            boot=self.boot,
            pairs=sum(len(p.pairing.pairs) for p in self.parts),
            skipped=[str(s.key) for p in self.parts for s in p.pairing.skipped],
            bytes_per_page=sum(p.pairing.bytes_per_page for p in self.parts),
            decode_stages=[p.stage for p in self.parts],
        )


class DecodeLinks:
    """Prefill stage side: handshake with decode workers on demand and cache the result per address."""

    def __init__(
        self,
        backend: TransferBackend,
        manifest: Manifest,
        hello: Hello,
        rpc_timeout: float = 5.0,
        *,
        grid: GridCheck | None = None,
        on_link: Callable[[str, HelloReply], None] | None = None,
    ) -> None:
        self.grid, self.on_link = grid, on_link
        self.backend = backend
        self.manifest = manifest
        self.hello = hello
        self.rpc_timeout = rpc_timeout
        self._links: dict[str, DecodeLink] = {}
        self._lock = threading.Lock()
        self._addr_locks: dict[str, threading.Lock] = {}

    def cached(self, addr: str) -> DecodeLink | None:
        with self._lock:
            return self._links.get(addr)

    def links(self) -> list[DecodeLink]:
        with self._lock:
            return list(self._links.values())

    def forget(self, addr: str) -> None:
        with self._lock:
            self._links.pop(addr, None)

    def get(self, addr: str, boot: str | None = None, timeout: float | None = None) -> DecodeLink:
        """The link to decode `addr`; handshake first if there is none or the decode restarted (boot differs)."""
        link = self.cached(addr)
        if link is not None and (boot is None or link.boot == boot):
            return link
        with self._lock:
            lock = self._addr_locks.setdefault(addr, threading.Lock())
        with lock:
            link = self.cached(addr)
            if link is not None and (boot is None or link.boot == boot):
                return link
            link = self._handshake(addr, self.rpc_timeout if timeout is None else timeout)
            with self._lock:
                self._links[addr] = link
            return link

    def _handshake(self, addr: str, timeout: float) -> DecodeLink:
        t0 = time.monotonic()
        client = RpcClient(addr, timeout=timeout)
        try:  # a refusal is re-raised as IncompatiblePeer / ManifestError (rpc.ERROR_KINDS)
            reply = client.request(HANDSHAKE, self.hello, timeout=timeout)
        finally:
            client.close()
        link = self.link_of(addr, reply)
        log.info(
            "%s -> decode %s (boot %s): handshake ok in %.3fs, decode stage(s) %s, %d buffers paired, "
            "%d one-sided index-K skipped",
            self.manifest.worker,
            addr,
            link.boot,
            time.monotonic() - t0,
            [p.stage for p in link.parts],
            sum(len(p.pairing.pairs) for p in link.parts),
            sum(len(p.pairing.skipped) for p in link.parts),
        )
        if self.on_link is not None:  # a TP stage's rank 0: its other ranks build the same link (prefill/ranks.py)
            self.on_link(addr, reply)
        return link

    def link_of(self, addr: str, reply: HelloReply) -> DecodeLink:
        """The link a decode's HelloReply describes, paired with this stage's manifest and connected through this
        stage's backend (rank 0's handshake; a TP stage's other ranks get the reply relayed and call this too)."""
        theirs = Manifest.from_bytes(reply.manifest)
        check_draft(self.manifest, theirs, self.hello.stage, self.hello.num_stages)
        stages = [(r.stage, Manifest.from_bytes(r.manifest)) for r in reply.stages] or [(0, theirs)]
        if self.grid is not None:
            self.grid(addr, stages, [(r.stage, r.rank) for r in reply.ranks])
        tp = 1 + max((r.rank for r in reply.ranks), default=0)  # the decode's TP ranks per stage
        leads = dict(stages)
        parts = []
        for j, m in stages:  # pair by key over the layers this stage shares with each decode stage
            if not any(m.holds_layer(layer) for layer in self.manifest.layers):
                continue
            pairing = check_pair(self.manifest, m)
            cell = j * tp if tp > 1 else 0
            parts.append(LinkPart(j, m, pairing, PairTable.of(pairing.pairs), self.backend.connect(m), cell=cell))
        for ref in reply.ranks:  # a TP decode: every rank of a stage holds its keys in a pool of its own
            m = Manifest.from_bytes(ref.manifest)
            lead = leads.get(ref.stage)
            if ref.rank < 1 or lead is None or m.keys != lead.keys:
                raise IncompatiblePeer(
                    f"decode {addr}: stage {ref.stage} TP rank {ref.rank} does not hold its stage's rank 0 keys"
                )
            if not any(m.holds_layer(layer) for layer in self.manifest.layers):
                continue
            pairing = check_pair(self.manifest, m)
            table, peer = PairTable.of(pairing.pairs), self.backend.connect(m)
            parts.append(LinkPart(ref.stage, m, pairing, table, peer, rank=ref.rank, cell=ref.stage * tp + ref.rank))
        if not parts:
            raise IncompatiblePeer(
                f"{self.manifest.worker} (layers {self.manifest.describe_layers()}) -> decode {addr}: no decode stage "
                f"holds any of its layers (stages hold {', '.join(m.describe_layers() for _, m in stages)})"
            )
        return DecodeLink(addr, reply.boot, theirs, tuple(parts), reply.grant_key)

    def put(self, addr: str, reply: HelloReply) -> DecodeLink:
        """Build and keep the link of a reply another rank of this stage handshook (a TP stage's rank r >= 1)."""
        link = self.link_of(addr, reply)
        with self._lock:
            self._links[addr] = link
        return link


GridCheck = Callable[[str, Sequence[tuple[int, Manifest]], Sequence[tuple[int, int]]], None]


def grid_check(prefill: RoleGrid, stage_keys: Callable[[int], Collection[BufferKey]]) -> GridCheck:
    """The handshake's rank-grid check for a prefill of grid `prefill` (its stages' keys: `stage_keys`): the
    decode's grid from its reply (its stages' layer ranges and keys, its TP ranks 1..) must announce every rank
    once, cover the same layers and draft layers, and every key a decode rank needs must have a prefill holder
    (rank_assign.check_announced / check_grids); IncompatiblePeer names the mismatch and both grids."""

    def check(addr: str, stages: Sequence[tuple[int, Manifest]], ranks: Sequence[tuple[int, int]]) -> None:
        ms = [m for _, m in sorted(stages, key=lambda jm: jm[0])]
        decode = RoleGrid(
            "decode",
            tuple((m.layer_start, m.layer_end) for m in ms),
            attention_tp=1 + max((r for _, r in ranks), default=0),
            draft_layers=len(ms[-1].draft_layers),
        )
        try:
            check_announced(decode, [RankId(j, 0, 0) for j, _ in stages] + [RankId(j, 0, r) for j, r in ranks],
                            ms[0].num_main_layers)  # fmt: skip
            check_grids(
                prefill,
                decode,
                prefill_dp=0,
                decode_dp=0,
                prefill_keys=stage_keys,
                decode_keys=lambda j: ms[j].keys,
                optional=lambda k: k.kind is Kind.INDEX_K,  # one-sided index-K: check_pair decides exactly
            )
        except ConfigError as e:
            raise IncompatiblePeer(
                f"decode {addr}: rank grids do not match ({prefill.describe()}; {decode.describe()}): {e}"
            ) from None

    return check


@dataclass
class StageEntry:
    """One handshaken prefill stage, as the decode worker sees it."""

    prefill: str
    stage: int
    num_stages: int
    rpc: str
    layer_start: int
    layer_end: int
    elide: bool
    skipped: list[str]
    decode_stages: list[int] = field(default_factory=lambda: [0])  # the decode stages it shares layers with
    boot: str = ""
    at: float = field(default_factory=time.monotonic)
    manifest: bytes = field(default=b"", repr=False)  # the hello's, as registered (its owner may only repeat it)
    tp_size: int = 1  # the stage's TP ranks: with num_stages, the prefill's rank grid (every stage the same)


class StageRegistry:
    """Decode side: the prefill stages that handshook, by (prefill name, stage)."""

    def __init__(self, manifest: Manifest, ping_timeout: float = 1.0) -> None:
        self.manifest = manifest
        self.ping_timeout = ping_timeout
        self._stages: dict[tuple[str, int], StageEntry] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def _check_hello(self, hello: Hello, theirs: Manifest) -> None:
        where = f"handshake from prefill {hello.prefill!r} stage {hello.stage}"
        if not hello.boot:
            raise MessageError(f"{where}: no boot id")
        if not 0 <= hello.stage < hello.num_stages:
            raise MessageError(f"{where}: stage {hello.stage} is not within its {hello.num_stages}-stage pipeline")
        try:
            _host, port = split_addr(hello.rpc)
        except ValueError as e:
            raise MessageError(f"{where}: rpc {e}") from None
        if not 0 < port < 65536:
            raise MessageError(f"{where}: rpc port {port} is not within 1-65535")
        if not 0 <= theirs.layer_start < theirs.layer_end <= self.manifest.num_main_layers:
            raise MessageError(f"{where}: layers {theirs.layer_start}-{theirs.layer_end - 1} are not a layer range")
        if (hello.stage == 0) != (theirs.layer_start == 0):
            raise MessageError(f"{where}: its manifest starts at layer {theirs.layer_start}")
        last = hello.stage == hello.num_stages - 1
        if last != (theirs.layer_end == self.manifest.num_main_layers):
            raise MessageError(
                f"{where}: its manifest ends at layer {theirs.layer_end - 1}, but it is "
                f"{'the last' if last else 'not the last'} of {hello.num_stages} stages"
            )

    def _check_grid(self, hello: Hello, where: str) -> None:
        """Every stage of one prefill announces the same rank grid (stages x TP ranks): a live stage registered
        with another grid refuses the hello, naming both (one proven gone is dropped: the prefill restarted)."""
        with self._lock:
            others = [e for (p, k), e in self._stages.items() if p == hello.prefill and k != hello.stage]
        for e in others:
            if (e.num_stages, e.tp_size) == (hello.num_stages, hello.tp_size) or e.boot == hello.boot:
                continue
            gone = self._gone(e)
            if gone is not None:
                log.info("decode: %s: dropping stage %d of another rank grid (%s)", where, e.stage, gone)
                with self._lock:
                    if self._stages.get((e.prefill, e.stage)) is e:
                        del self._stages[(e.prefill, e.stage)]
                continue
            self.refused += 1
            raise IncompatiblePeer(
                f"{where} announces a rank grid of {hello.num_stages} stage(s) x TP {hello.tp_size}, but its stage "
                f"{e.stage} (boot {e.boot} at {e.rpc}) registered {e.num_stages} stage(s) x TP {e.tp_size}: every "
                "stage of a prefill runs the same --pp-size and --tp-size (restart the stages with one grid)"
            )

    def _gone(self, e: StageEntry) -> str | None:
        """Why the registered stage's process is proven gone (nothing listens at its address, or another process
        answers there), or None if it is not: it answers as itself, or does not answer (stalled: it may resume)."""
        host, port = split_addr(e.rpc)
        c = RpcClient(e.rpc, timeout=self.ping_timeout, connect_timeout=self.ping_timeout / 2)
        try:
            boot = c.request(PING, Ping(), timeout=self.ping_timeout).boot
        except PeerUnavailable:
            try:
                with socket.create_connection((host, port), timeout=self.ping_timeout / 2):
                    return None  # it accepts but does not answer: stalled
            except ConnectionRefusedError:
                return f"nothing listens at {e.rpc}"
            except OSError:
                return None
        except RpcError:
            return None  # it answers with an error: alive
        finally:
            c.close()
        return f"{e.rpc} answers as boot {boot}" if boot != e.boot else None

    def accept(self, hello: Hello, stages: Sequence[tuple[int, Manifest]] = ()) -> tuple[StageEntry, Pairing]:
        """Check a stage's hello against this worker's manifest, or (a pipelined decode) against every decode
        stage in `stages` that holds some of its layers (entry.decode_stages names them); raise IncompatiblePeer
        (or ManifestError / MessageError) naming what differs, Forbidden if it would replace a live registration.
        Nothing is registered unless it passes. Returns the entry and the pairing with the first such stage."""
        theirs = Manifest.from_bytes(hello.manifest)
        self._check_hello(hello, theirs)
        check_draft(theirs, self.manifest, hello.stage, hello.num_stages)
        ours = (
            [(j, m) for j, m in stages if any(m.holds_layer(x) for x in theirs.layers)]
            if stages
            else [(0, self.manifest)]
        )
        if not ours:
            raise IncompatiblePeer(
                f"prefill {hello.prefill} stage {hello.stage} holds layers {theirs.describe_layers()}: no stage of "
                f"this decode pipeline holds any of them ({', '.join(m.describe_layers() for _, m in stages)})"
            )
        pairings = [check_pair(theirs, m) for _, m in ours]
        where = f"prefill {hello.prefill!r} stage {hello.stage}"
        self._check_grid(hello, where)
        with self._lock:
            old = self._stages.get((hello.prefill, hello.stage))
        if old is not None and old.boot == hello.boot:  # its owner again: only exactly what it registered
            if old.manifest != hello.manifest or (old.num_stages, old.rpc) != (hello.num_stages, hello.rpc):
                self.refused += 1
                raise Forbidden(
                    f"{where} (boot {old.boot}) registered layers {old.layer_start}-{old.layer_end - 1} of "
                    f"{old.num_stages} stages at {old.rpc}; a handshake under the same boot with layers "
                    f"{theirs.layer_start}-{theirs.layer_end - 1} of {hello.num_stages} at {hello.rpc} is refused (a "
                    "process never changes its layers or address: a restarted stage has a new boot id)"
                )
        elif old is not None:  # another process: only once the registered one is proven gone
            gone = self._gone(old)
            if gone is None:
                self.refused += 1
                raise Forbidden(
                    f"{where} is registered by boot {old.boot} at {old.rpc}, which still answers or may resume (it "
                    f"answers its ping as itself, or stalls: no answer within {self.ping_timeout:g}s); a handshake "
                    f"from boot {hello.boot} at {hello.rpc} cannot replace it until that process is gone: give a "
                    "second prefill worker its own --worker-name, or retry once the old stage exited"
                )
            log.info("decode: %s: boot %s replaces boot %s (%s)", where, hello.boot, old.boot, gone)
        entry = StageEntry(
            prefill=hello.prefill,
            stage=hello.stage,
            num_stages=hello.num_stages,
            rpc=hello.rpc,
            layer_start=theirs.layer_start,
            layer_end=theirs.layer_end,
            elide=theirs.elide,
            skipped=[str(s.key) for p in pairings for s in p.skipped],
            decode_stages=[j for j, _ in ours],
            boot=hello.boot,
            manifest=hello.manifest,
            tp_size=hello.tp_size,
        )
        with self._lock:
            self._stages[(entry.prefill, entry.stage)] = entry
        log.info(
            "decode: prefill %s stage %d/%d (layers %d-%d, elide %s, rpc %s) handshook; skipped %s",
            entry.prefill,
            entry.stage,
            entry.num_stages,
            entry.layer_start,
            entry.layer_end - 1,
            entry.elide,
            entry.rpc,
            entry.skipped or "nothing",
        )
        return entry, pairings[0]

    def stages_of(self, prefill: str, num_stages: int) -> list[StageEntry]:
        """Every stage of `prefill`, checked to cover all main layers once; raise IncompatiblePeer otherwise."""
        with self._lock:
            found = [self._stages.get((prefill, k)) for k in range(num_stages)]
        missing = [k for k, e in enumerate(found) if e is None]
        if missing:
            raise IncompatiblePeer(
                f"prefill {prefill}: stage(s) {missing} of {num_stages} have not handshaken with this decode worker: "
                "connect the prefill worker to this decode first (the router does it when it pairs them)"
            )
        entries = [e for e in found if e is not None]
        want = 0
        for e in entries:
            if e.layer_start != want or e.num_stages != num_stages:
                raise IncompatiblePeer(
                    f"prefill {prefill}: stage {e.stage} holds layers {e.layer_start}-{e.layer_end - 1} of a "
                    f"{e.num_stages}-stage pipeline, expected layers from {want} of a {num_stages}-stage pipeline"
                )
            want = e.layer_end
        if want != self.manifest.num_main_layers:
            raise IncompatiblePeer(
                f"prefill {prefill}: its stages cover layers 0-{want - 1}, not all {self.manifest.num_main_layers}"
            )
        return entries

    def entry(self, prefill: str, stage: int) -> StageEntry | None:
        with self._lock:
            return self._stages.get((prefill, stage))

    def boot_of(self, prefill: str, stage: int) -> str | None:
        """The boot id registered now for a stage (a restarted stage re-registers under its new one)."""
        with self._lock:
            e = self._stages.get((prefill, stage))
        return e.boot if e is not None else None

    def entries(self) -> list[StageEntry]:
        with self._lock:
            return list(self._stages.values())
