"""Every time bound of disaggregated serving, in one dataclass (seconds), and the longest any of them may be.

Each role's config (dsakv.config.roles) hands its code one `Timeouts` (`cfg.timeouts`), built one way
(`Timeouts.of`) from the fields its command-line flags set (RouterConfig's own; PrefillConfig / DecodeConfig:
the tree's transfer.rpc_timeout and pipeline.stage_timeout, plus the decode's kv_grace / liveness_interval /
max_kv_timeout); nothing else in dsakv.disagg spells a time constant. MAX_KV_TIMEOUT and MAX_WAIT bound the
flags here and the wire messages' fields (disagg/protocol/messages_base.py). Imports nothing from dsakv but
errors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dsakv.errors import ConfigError

MAX_KV_TIMEOUT = 3600.0  # seconds: a request's prefill + KV deadline (every page a decode holds has one)
MAX_WAIT = 600.0  # seconds: long polls, connect timeouts


@dataclass(frozen=True)
class Timeouts:
    rpc: float = 5.0  # one control RPC (--rpc-timeout)
    connect: float = 2.0  # the TCP connect of a control RPC (at most `rpc`)
    kv: float = 30.0  # router: prefill + KV transfer of one request, from dispatch (--kv-timeout)
    kv_grace: float = 1.0  # decode: wait this long past a request's KV deadline before failing it
    max_kv: float = 120.0  # decode: the longest kv_timeout a prealloc may ask for (--max-kv-timeout)
    queue: float = 60.0  # router: a request waits at most this long for a pair / decode pages (--queue-timeout)
    stage: float = 10.0  # prefill: one send / receive between pipeline stages (--stage-timeout)
    health_interval: float = 0.5  # router: poll every worker's health this often (--health-interval)
    health_call: float = 2.0  # router: one health call (at most `rpc`)
    poll_wait: float = 0.5  # router: one long-poll of a decode worker's events
    max_poll_wait: float = 5.0  # decode: the longest events long-poll it holds open
    connect_retry: float = 2.0  # router: between handshake attempts of a pair that failed
    liveness_interval: float = 0.5  # decode: ping the prefill stages that requests wait for this often
    ping: float = 1.0  # decode: one liveness ping (connect: half of it)
    silent: float = 3.0  # decode: a stage whose pings go unanswered this long is 'not answering' (its requests fail)
    busy_backoff: float = 0.02  # router: a decode that said NoFreePages is not asked again for this long
    side_call: float = 2.0  # router: one best-effort abort (at most `rpc`)
    report_floor: float = 0.5  # prefill: a stage_done report gets at least this long, past the KV deadline
    startup_wait: float = 60.0  # prefill: wait this long for each --decode to come up at startup
    busy_health: float = (
        30.0  # router: a worker that answers PING but not HEALTH (busy in a long step) stays up this long
    )

    @classmethod
    def of(cls, rpc: float, **bounds: float) -> Timeouts:
        """The one way a role builds its bounds (each role config's `timeouts`): `rpc` bounds every control call,
        and so its TCP connect too (at most the default `connect`); `bounds` are the role's other flags."""
        return cls(rpc=rpc, connect=min(cls.connect, rpc), **bounds)

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if not getattr(self, f.name) > 0]
        if bad:
            raise ConfigError(f"time bounds must be > 0 seconds: {', '.join(bad)}")

    @property
    def tick(self) -> float:
        """Prefill stage 0 sends an idle tick this often, so a later stage's receive never times out."""
        return min(1.0, self.stage / 4)

    def connect_for(self, timeout: float) -> float:
        """The connect bound of a call bounded by `timeout`."""
        return min(self.connect, timeout)

    @property
    def health_rpc(self) -> float:
        return min(self.rpc, self.health_call)

    @property
    def side_rpc(self) -> float:
        return min(self.rpc, self.side_call)
