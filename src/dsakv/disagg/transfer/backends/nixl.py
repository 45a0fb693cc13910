"""NixlBackend: a nixl_cu12 agent (package nixl-cu12==1.5.1) with the UCX plugin.

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))   no listener thread: metadata travels
    meta  = agent.get_agent_metadata()                              in our manifest, after registration
    peer  = agent.add_remote_agent(meta)                            fails at once for an unreachable peer

What the engine does, measured with nixl-cu12 1.5.1 (UCX over TCP on lo):
- register_memory of a zero-length region is ACCEPTED silently (base.register refuses it first);
  address 0 is refused (NIXL_ERR_BACKEND); a double registration is accepted.
- Errors are exceptions (nixlBackendError, nixlNotFoundError, nixlRemoteDisconnectError, ...):
  their name is the code carried by TransferError.
- A dead peer fails at once (NIXL_ERR_REMOTE_DISCONNECT); a hung peer stays "PROC" forever, so
  the deadline in poll() is what ends it (release_xfer_handle cancels). Bytes already sent still
  land if the hung peer resumes: quarantine_s is a conservative guess, UCX gives no bound.
- Python logs go to stdout at INFO ("Backend UCX was instantiated"): the 'nixl' logger is set to
  WARNING here. UCX picks its transports from UCX_TLS / UCX_NET_DEVICES; on one host use
  dsakv.config.LOOPBACK_UCX_ENV (tcp on lo) to exercise the network path.
- A peer's metadata lists the memory it had registered when it was taken: register everything
  before publishing the manifest.
Imports the engine lazily (in __init__). Imports numpy and disagg.backends.{base, registry}.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsakv.disagg.protocol.errors import TransferError
from dsakv.disagg.transfer.backends.base import Peer, Span, TransferBackend, TransferStatus
from dsakv.disagg.transfer.backends.registry import register_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.plan import Blocks

log = logging.getLogger(__name__)


def _code(e: BaseException) -> str:
    return str(e) or type(e).__name__


@dataclass
class _NixlJob:
    handles: list[Any] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)


_AGENT_LOCK = threading.Lock()


def _make_agent(nixl: Any, name: str, cfg: Any, progress_delay_us: int) -> Any:
    """nixl_agent(name, cfg) with its progress thread sleeping `progress_delay_us` between passes.

    nixl_cu12 1.5.1 hard-codes pthrDelay = 0: the progress thread of every agent then spins a whole core
    (measured: ~100% of a CPU per idle worker process). The agent config is built inside nixl_agent(), so its
    pthrDelay assignment is intercepted with a subclass of the config type while the agent is created. 1 ms
    keeps a 64 KiB write at ~0.1 ms (the initiator progresses its own transfers when it polls them).
    """
    api = nixl._api
    orig = api.nixlBind.nixlAgentConfig

    class _Config(orig):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, int(progress_delay_us) if key == "pthrDelay" else value)

    with _AGENT_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return nixl.nixl_agent(name, cfg)
        finally:
            api.nixlBind.nixlAgentConfig = orig


@register_backend
class NixlBackend(TransferBackend):
    name = "nixl"
    default_max_blocks_per_batch = 1 << 16
    quarantine_s = 30.0  # bytes already in a hung peer's socket land if it resumes: no bound from UCX

    def __init__(
        self,
        agent_name: str | None = None,
        mem_type: str = "DRAM",
        device_id: int = 0,
        plugins: tuple[str, ...] = ("UCX",),
        max_blocks_per_batch: int | None = None,
        env: Mapping[str, str] | None = None,
        quiet: bool = True,
        progress_delay_us: int = 1000,
    ) -> None:
        super().__init__(max_blocks_per_batch)
        for k, v in (env or {}).items():
            os.environ.setdefault(k, v)  # UCX reads its environment when the agent is created
        try:
            import nixl_cu12
        except ImportError as e:
            raise TransferError(
                f"the nixl backend needs the package nixl-cu12==1.5.1 (module nixl_cu12): pip install it ({e})",
                backend=self.name,
            ) from None
        if quiet:
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.mem_type = mem_type
        self.device_id = int(device_id)
        self.agent_name = agent_name or f"dsakv-{uuid.uuid4().hex[:12]}"
        cfg = nixl_cu12.nixl_agent_config(
            backends=list(plugins), sync_mode=nixl_cu12.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        try:
            self._agent = _make_agent(nixl_cu12, self.agent_name, cfg, progress_delay_us)
        except Exception as e:
            raise TransferError(
                f"nixl: creating agent {self.agent_name!r} failed: {e}", backend=self.name, code=_code(e)
            ) from None
        missing = [p for p in plugins if p not in self._agent.backends]
        if missing:
            raise TransferError(
                f"nixl: plugin(s) {missing} unavailable (available: {self._agent.get_plugin_list()})",
                backend=self.name,
            )
        self._reg: dict[Hashable, Any] = {}
        self._remotes: set[str] = set()

    def _engine_register(self, key: Hashable, span: Span) -> int | str:
        try:
            self._reg[key] = self._agent.register_memory([(span.addr, span.nbytes, self.device_id, "")], self.mem_type)
        except Exception as e:
            return _code(e)
        return 0

    def _engine_unregister(self, key: Hashable, span: Span) -> int | str:
        descs = self._reg.pop(key, None)
        if descs is None:
            return "not registered"
        try:
            self._agent.deregister_memory(descs)
        except Exception as e:
            return _code(e)
        return 0

    def _engine_meta(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _engine_connect(self, meta: bytes, manifest: Manifest) -> Any:
        try:
            name = self._agent.add_remote_agent(meta)
        except Exception as e:
            raise TransferError(
                f"nixl: peer {manifest.worker!r} is unreachable or its metadata is invalid ({_code(e)})",
                backend=self.name,
                code=_code(e),
            ) from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def _descs(self, addr: np.ndarray, length: np.ndarray) -> Any:
        arr = np.empty((addr.size, 3), dtype=np.uint64)
        arr[:, 0] = addr
        arr[:, 1] = length
        arr[:, 2] = self.device_id
        return self._agent.get_xfer_descs(arr, self.mem_type)

    def _engine_submit(self, peer: Peer, batches: list[Blocks], deadline: float) -> Any:
        job = _NixlJob()
        try:
            for b in batches:
                h = self._agent.initialize_xfer(
                    "WRITE", self._descs(b.src, b.length), self._descs(b.dst, b.length), str(peer.address)
                )
                job.handles.append(h)
                state = self._agent.transfer(h)
                if state == "ERR":
                    raise TransferError(
                        f"nixl -> {peer.name}: posting a transfer failed", backend=self.name, code="ERR"
                    )
                job.pending.append(h)
        except TransferError:
            self._release(job)
            raise
        except Exception as e:
            self._release(job)
            raise TransferError(
                f"nixl -> {peer.name}: submit failed with {_code(e)}", backend=self.name, code=_code(e)
            ) from None
        return job

    def _engine_poll(self, job: Any) -> tuple[TransferStatus, TransferError | None]:
        still = []
        for h in job.pending:
            try:
                state = self._agent.check_xfer_state(h)
            except Exception as e:
                self._release(job)
                return TransferStatus.FAILED, TransferError(
                    f"nixl: transfer failed with {_code(e)}", backend=self.name, code=_code(e)
                )
            if state == "ERR":
                self._release(job)
                return TransferStatus.FAILED, TransferError("nixl: transfer state ERR", backend=self.name, code="ERR")
            if state != "DONE":
                still.append(h)
        job.pending = still
        if still:
            return TransferStatus.PENDING, None
        self._release(job)
        return TransferStatus.DONE, None

    def _release(self, job: _NixlJob) -> None:
        for h in job.handles:
            try:
                self._agent.release_xfer_handle(h)
            except Exception as e:  # best effort: a handle that cannot be cancelled is logged
                log.warning("nixl: releasing a transfer handle failed: %s", _code(e))
        job.handles.clear()
        job.pending.clear()

    def _engine_cancel(self, job: Any) -> None:
        self._release(job)

    def _engine_close(self) -> None:
        for name in self._remotes:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:
                log.debug("nixl: removing remote agent %s: %s", name, _code(e))
        self._remotes.clear()
