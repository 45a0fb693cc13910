"""Decode pipeline stage k > 0 (DecodeStageWorker: a process of its own): its layers' pool, registered with its
transfer engine so prefill stages write it; a mirror of stage 0's books; the loop that runs its layers of every
decode step through the pipeline's StageFollower (pipeline/follower.py, as a colocated `--pp-size` stage does) and
re-forms the group when it breaks; with --tp-size T its rank 0 relays every message to ranks 1..T-1 (pipeline/relay.py,
decode/grid.py). See decode/stage.py for the
pipeline as a whole and stage 0's side (DecodePipeline).
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig
from dsakv.disagg.decode.stage import _group, _load, _span, stage_pool_shape, tp_stage_model
from dsakv.disagg.protocol.messages import DECODE_FOLLOWER_SERVICE, DecodeHealth, PingReply
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.ranks import RankDown, Ranks
from dsakv.pipeline.follower import StageFollower
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.relay import RelayGroup
from dsakv.pipeline.stage_comm import StageLinkError
from dsakv.pipeline.step import STOP

log = logging.getLogger(__name__)


class DecodeStageWorker:
    """Decode stage k > 0: its layers' pool (registered with its transfer engine: prefill stages write it), a
    mirror of stage 0's books, and the loop that runs its layers of every decode step."""

    reform = True  # a broken pipeline forms again (not with DP attention: decode/dp_pipe.py)

    def __init__(self, cfg: DecodeConfig, model: tuple[Any, Any] | None = None) -> None:
        assert cfg.pipeline is not None and cfg.pipeline.rank > 0
        self.cfg = cfg
        self.rank, self.size = cfg.pipeline.rank, cfg.pipeline.pp_size
        self.ranks: Ranks | None = None  # --tp-size T: this stage's TP group (its rank 0 relays, decode/grid.py)
        if model is None and cfg.tp_size > 1:
            self.ranks, model = tp_stage_model(cfg)
        self.spec, self.model = _load(cfg, model)
        self.model.eval()
        _, layouts, self.num_pages = stage_pool_shape(cfg, self.spec)
        self.layout = layouts[self.rank]
        self.last = self.rank == self.size - 1
        self.pool = DevicePool(self.layout, self.num_pages, device=self.model.device)
        self.name = cfg.name or f"decode@{cfg.host}:{cfg.port}"
        self.mirror = PageMirror(self.num_pages, name=f"{self.name} stage {self.rank} pool")
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.pool.regions())
        self.manifest = Manifest.from_pool(self.pool, self.backend.meta(), worker=f"{self.name}/stage{self.rank}")
        self.rank_manifests: list[bytes] = []  # ranks 1.. of this stage (their pools), published when it forms
        if self.ranks is None:
            self.group = _group(cfg, self.model, self.spec)
        else:
            self.rank_manifests = [bytes(m) for m in self.ranks.gather(b"")[1:]]
            self.group = _group(cfg, self.model, self.spec, RelayGroup)
            cast(RelayGroup, self.group).bind(self.ranks)
        self.stage_timeout = cfg.pipeline.stage_timeout
        self.follower: StageFollower[Any] = StageFollower(
            self.group, self.model, self.pool, self.mirror, self.stage_timeout
        )
        self.down_reason: str | None = "pipeline not formed yet"
        self.breaks = 0
        self.service = WorkerService(
            DECODE_FOLLOWER_SERVICE,
            {},
            cfg.host,
            cfg.port + self.rank,
            f"decode{self.rank}",
            health=self.health,
            integrity=self.integrity,
            ping=lambda: PingReply(pid=os.getpid(), boot=self.boot, stage=self.rank, epoch=self.group.epoch),
        )
        self.boot = self.service.boot
        log.info(
            "decode %s stage %d/%d: layers %s (producers %s), %d pages x %d tokens, %d B/token, backend %s, rpc %s",
            self.name,
            self.rank,
            self.size,
            self.layout.describe_range(),
            list(self.layout.producers) or "none: its shared layers reuse the carried top-k",
            self.num_pages,
            self.layout.page_size,
            self.layout.bytes_per_token,
            cfg.config.transfer.backend,
            self.address,
        )

    @property
    def address(self) -> str:
        return self.service.address

    def start(self) -> DecodeStageWorker:
        self.service.start([(self._loop, f"decode-stage{self.rank}")])
        return self

    def request_stop(self) -> None:
        self.service.request_stop()

    def stop(self) -> None:
        self.service.request_stop()
        self.service.stop(join_timeout=self.stage_timeout + 2)
        if isinstance(self.group, RelayGroup):
            self.group.stop_ranks()  # the TP ranks stop (a dead one is named)
        self.group.close()
        self.backend.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()

    def _loop(self) -> None:
        info = {"rpc": self.address, "pid": os.getpid(), "boot": self.boot, "manifest": self.manifest.to_bytes()}
        info["ranks"] = self.rank_manifests
        stopping = self.service.stopping
        while not stopping.is_set():
            try:
                if not self.group.formed:
                    if self.breaks and not self.reform:
                        stopping.wait(0.2)
                        continue
                    if self.group.form(info):
                        self.down_reason = None
                        log.info("decode %s stage %d: serving (epoch %s)", self.name, self.rank, self.group.epoch)
                    continue
                self.iteration()
            except StageLinkError as e:
                self._on_break(str(e))
            except Exception as e:
                dead = self.ranks.guard(e) if self.ranks is not None else e
                if isinstance(dead, RankDown) and isinstance(self.group, RelayGroup):  # a TP rank died in a step
                    self.group.leave(str(dead))  # names it to stage 0, never rejoins
                    self._on_break(str(dead))
                    continue
                log.exception("decode %s stage %d: step failed", self.name, self.rank)
                why = f"decode stage {self.rank} step failed: {type(e).__name__}: {e}"
                self.group.break_(why)
                self._on_break(why)

    def iteration(self) -> None:
        """One message from stage k-1 through the pipeline's follower (pipeline/follower.py); the decode never sends
        STOP (its stages re-form instead), so one would be a protocol error."""
        if self.follower.iteration() == STOP:
            raise StageLinkError(f"stage {self.rank}: a decode pipeline got STOP from stage {self.rank - 1}")

    def _on_break(self, why: str) -> None:
        """The pipeline broke: stage 0 fails what it held; this stage forgets its mirror and re-forms (not once a TP
        rank of it died: RelayGroup.gone names it)."""
        self.down_reason = getattr(self.group, "gone", None) or why
        self.breaks += 1
        self.follower.forget()
        log.warning("decode %s stage %d: pipeline broke (%s)", self.name, self.rank, why)

    def integrity(self) -> str:
        return self.mirror.integrity()

    def health(self) -> DecodeHealth:
        used = self.mirror.num_used
        return DecodeHealth(
            ok=self.group.formed and self.down_reason is None and not self.service.stopping.is_set(),
            role="decode",
            name=self.name,
            pid=os.getpid(),
            boot=self.boot,
            elide=self.layout.elide,
            backend=self.cfg.config.transfer.backend,
            page_size=self.layout.page_size,
            pages_total=self.num_pages,
            pages_used=used,
            pages_free=self.num_pages - used,
            capacity_tokens=self.num_pages * self.layout.page_size,
            bytes_per_token=self.layout.bytes_per_token,
            integrity=self.integrity(),
            counters={**self.follower.stats.as_dict(), "breaks": self.breaks},
            stage=self.rank,
            num_stages=self.size,
            epoch=self.group.epoch,
            down=self.down_reason,
            layers=_span(self.layout),
            running=len(self.mirror.owners),
        )


__all__ = ["DecodeStageWorker"]
