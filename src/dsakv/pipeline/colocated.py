"""The colocated pipeline: `dsakv generate --pp-size N` and `dsakv serve --pp-size N` on one machine.

The command a user starts is stage 0: it starts stages 1..N-1 as copies of itself (same argv, DSAKV_PP_RANK /
DSAKV_PP_PORT / DSAKV_PP_SIZE set; each dies with stage 0), and the stages form a gloo group on 127.0.0.1
(stage_comm.StageGroup, the rendezvous on a free port). Every stage loads the checkpoint and builds a pool over
its layer range (`--pp-partition a,b,..`, default an even split), all with stage 0's page count.

    stage 0: an Engine over layers [0, a) (scheduler, allocator, sampling) whose RoundTripRunner sends each step
             (PipeStep: batch + the books) with the hidden states and top-k to stage 1 and gets the last
             stage's logits back; the Engine samples there, so tokens equal the single-process engine's
    stage k: StageFollower (pipeline/follower.py), until stage 0 sends STOP (exit 0) or the link breaks (exit 1)

Liveness: stage 0 polls its stage processes (a watcher thread); a stage that dies makes the step in flight and
every later one fail with StageDown naming it and its exit status (/health 503 under serve; generate exits 2).
The group is not re-formed: restart the command. Refused with N > 1 (clear errors, before anything starts):
speculative decoding, HiSparse, the prefix cache and its tiers (cli/validate).
With `--tp-size T` each stage is T processes, its rank 0 in the pipeline (pipeline/tp_stage.py). With DP attention
(`dp`) each DP rank is a pipeline of its own, each stage's DP ranks its EP group (pipeline/dp_stage.py): stage 0 steps
in lockstep rounds, a round without a forward on this rank runs `idle_step`. Prompt
logprobs: stage 0 names the positions in the step (PipeStep.logits_at), the last stage sends their logits back after
the chunks'.
Imports torch, dsakv.{util, spec, plan, engine, cache, model} and the pipeline's own modules.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dsakv.config import EngineConfig, PipelineConfig, PoolConfig, split_layers
from dsakv.engine.engine import Engine
from dsakv.engine.ranks import RankDown, Ranks, dead_child
from dsakv.engine.request import RequestOutput, SamplingParams
from dsakv.engine.scheduler import SchedulerOutput
from dsakv.errors import ConfigError, Unavailable
from dsakv.model.parallel import idle_forward
from dsakv.pipeline.dp_stage import guard_stage, load_dp_model, stage_env
from dsakv.pipeline.runner import RoundTripRunner, Stage0
from dsakv.pipeline.stage_comm import StageLinkError, StageMessage
from dsakv.pipeline.step import IDLE, STOP, PipeStep, StepBooks
from dsakv.pipeline.tp_stage import load_stage_model, make_group
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.util.procs import CHILD_ENV, PP_RANK_ENV, Proc, dsakv_cmd, free_ports

log = logging.getLogger(__name__)

PORT_ENV, SIZE_ENV = "DSAKV_PP_PORT", "DSAKV_PP_SIZE"
ADDR = "127.0.0.1"
POLL_S = 0.1  # how often stage 0 polls its stage processes
STARTUP_S = 300.0  # the longest the stages may take to load and form the group
EXIT_TIMEOUT_S = 30.0


class StageDown(Unavailable):
    """A stage of the colocated pipeline died or its link broke: names it; no step can run any more."""


def refusal(ec: EngineConfig, pp_size: int) -> str | None:
    """Why the engine branch cannot run as a colocated pipeline of `pp_size` stages (None: it can)."""
    if pp_size <= 1:
        return None
    for flag, on in (
        ("--speculative-num-steps", ec.speculative_num_steps),
        ("--hisparse", ec.hisparse.enabled),
        ("the prefix cache (--prefix-cache / --hicache-*)", ec.cache.enabled),
    ):
        if on:
            return f"--pp-size {pp_size} with {flag} is not supported yet: drop one of them"
    return None


def check_refusal(ec: EngineConfig, pp_size: int) -> None:
    """ConfigError naming what the engine branch has that a colocated pipeline of `pp_size` stages cannot run."""
    why = refusal(ec, pp_size)
    if why is not None:
        raise ConfigError(why)


def stage_shape(ec: EngineConfig, spec: ModelSpec, pipe: PipelineConfig) -> tuple[list[KVLayout], int]:
    """Every stage's layout and the one page count all stage pools share (with --kv-budget: the planner's figure
    for the stage holding the most per token)."""
    check_refusal(ec, pipe.pp_size)
    layouts = [ec.layout.layout(spec, a, b) for a, b in split_layers(spec.num_layers, pipe.pp_size, pipe.partition)]
    return layouts, ec.pool.pages(layouts)


def _load(model_dir: Path, ec: EngineConfig, ranks: Ranks | None = None, dp: bool = False) -> tuple[ModelSpec, Any]:
    """The stage's model: the whole checkpoint, this TP rank's shard of it (pipeline/tp_stage.py) or, with DP
    attention, the whole checkpoint with this DP rank's experts (pipeline/dp_stage.py)."""
    from dsakv.model.loader import load_model

    if dp and ranks is not None:
        return load_dp_model(model_dir, getattr(torch, ec.dtype), ranks)  # type: ignore[no-any-return]
    if ranks is not None and ranks.size > 1:
        return load_stage_model(model_dir, getattr(torch, ec.dtype), ranks)  # type: ignore[no-any-return]

    spec, model = load_model(model_dir, dtype=getattr(torch, ec.dtype), weight_dtype=ec.weight_dtype)
    model.eval()
    return spec, model


class PipelinedEngine:
    """Stage 0 of a colocated pipeline: the Engine API (add_request, abort, step; the rest passed through) over an
    Engine whose steps run through every stage. `close()` stops the stages."""

    def __init__(
        self,
        model_dir: Path,
        ec: EngineConfig,
        pipe: PipelineConfig,
        port: int,
        children: Sequence[Proc],
        ranks: Ranks | None = None,
        dp: bool = False,
    ):
        self.children = list(children)
        self.dp = dp  # DP attention x PP: lockstep rounds (pipeline/dp_stage.py); `ranks` is stage 0's EP group
        self.last_ran = False  # the last step ran a forward (a round-trip)
        self.size = pipe.pp_size
        self.stage_timeout = pipe.stage_timeout
        self.tick_s = min(1.0, pipe.stage_timeout / 4)
        self.down: str | None = None
        self.books = StepBooks()
        self._last_send = 0.0
        self._closed = False
        spec, model = _load(model_dir, ec, ranks, dp)
        layouts, pages = stage_shape(ec, spec, pipe)
        self.layers = layouts[0].main_layers
        self.group = make_group(
            0, self.size, port, pipe.stage_timeout, model.dtype, spec.hidden_size, None if dp else ranks
        )
        self.ctx = Stage0(model, layouts[0].page_size, self.size, self.group, pipe.stage_timeout)
        self.runner: RoundTripRunner | None = None
        self.engine = Engine(
            (spec, model),
            replace(ec, pool=PoolConfig(num_pages=pages)),
            model_dir=model_dir,
            layout=layouts[0],
            runner=self._make_runner,
        )
        self.engine.on_schedule = self._on_schedule
        self._form(pages)
        threading.Thread(target=self._watch, name="dsakv-stage-watch", daemon=True).start()
        log.info(
            "pipeline: %d stages formed (epoch %s): %s; %d pages each",
            self.size, self.group.epoch, ", ".join(f"stage {k} layers {lay.describe_range()}"
                                                   for k, lay in enumerate(layouts)), pages,
        )  # fmt: skip

    def _on_schedule(self, sched: SchedulerOutput) -> None:
        for r in sched.preempted:  # the later stages drop their books of these
            self.books.dropped(r.request_id)

    def _make_runner(self, pool: Any) -> RoundTripRunner:
        self.runner = RoundTripRunner(self.ctx, pool, self.books.step, PipeStep.meta, self._sent, self._link_error)
        return self.runner

    def _sent(self) -> None:
        self._last_send = time.monotonic()

    def _form(self, pages: int) -> None:
        """Form the group (bounded by STARTUP_S); a stage that dies first, or whose pool differs, fails at once."""
        end = time.monotonic() + STARTUP_S
        while not self.group.form({"pid": os.getpid(), "pages": pages}):
            dead = dead_child(self.children)
            if dead is not None:
                raise StageDown(f"{dead} before joining the pipeline of {self.size} stages (its error is above)")
            if time.monotonic() > end:
                raise StageDown(f"the pipeline of {self.size} stages did not form within {STARTUP_S:g} s")
        for k, info in sorted(self.group.peer_info.items()):
            if info.get("pages") != pages:
                raise ConfigError(f"pipeline stage {k} built {info.get('pages')} pages, stage 0 {pages}: a bug")

    def _watch(self) -> None:
        while not self._closed and self.down is None:
            dead = dead_child(self.children)
            if dead is not None and not self._closed:
                self._set_down(f"pipeline stage down: {dead}")
                return
            time.sleep(POLL_S)

    def _set_down(self, why: str) -> None:
        noted = self.group.noted_down()  # a TP stage's rank 0 noted which of its ranks died (pipeline/tp_stage.py)
        why = f"{why} ({noted})" if noted else why
        if self.down is None:
            self.down = why
            log.error("%s: every request in flight fails; restart to re-form the pipeline", why)

    def _link_error(self, e: StageLinkError) -> Exception:
        """The error a broken link fails the step with: the stage process that died, when one did (its death can
        take a moment to be seen after its sockets closed: polled up to the stage timeout)."""
        end = time.monotonic() + self.stage_timeout
        while self.down is None and time.monotonic() < end:
            dead = dead_child(self.children)
            if dead is not None:
                self._set_down(f"pipeline stage down: {dead}")
                break
            time.sleep(POLL_S / 2)
        if self.down is None:
            self._set_down(f"pipeline link broken: {e}")
        return StageDown(f"{self.down} ({e})")

    # ---- the Engine API ------------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        if self.down is not None:
            raise StageDown(self.down)
        return str(self.engine.add_request(prompt_ids, params, request_id=request_id))

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.engine.abort(request_id)
        if out is not None:
            self.books.dropped(request_id)
        return out

    def step(self) -> list[RequestOutput]:
        """One step through every stage (an idle tick when due); StageDown naming the stage once one died."""
        self.last_ran = False
        if self.down is not None:
            if self.dp:  # the round's row said up: this rank's share of it is idle_step's (no forward)
                return []
            raise StageDown(self.down)
        assert self.runner is not None
        outs = self.engine.step()
        for o in outs:
            if o.finished:
                self.books.dropped(o.request_id)
        ran, self.runner.ran = self.runner.ran, False
        self.last_ran = ran
        broken, self.runner.broken = self.runner.broken, None
        if broken is not None:
            if self.dp:  # its requests failed naming the stage; the next round's row says this rank is down
                return outs
            raise StageDown(broken)
        if self.dp:  # a round without a forward here sends IDLE (idle_step), the books with it
            return outs
        if not ran and (self.books.pending or time.monotonic() - self._last_send >= self.tick_s):
            self._send(self.books.tick())
        return outs

    def idle_step(self) -> None:
        """DP attention x PP: a round this DP rank ran no forward in: stage 0's MoE layers with 0 rows, then IDLE
        (with the books) down the pipeline, on which every later stage does the same (pipeline/dp_stage.py)."""
        idle_forward(self.engine.model, self.layers)
        if self.down is None:
            try:
                self._send(self.books.tick(IDLE))
            except StageDown:  # down now (named): the next round's row says so
                pass

    def _send(self, step: PipeStep) -> None:
        try:
            self.group.send_next(StageMessage(self.runner.step if self.runner else 0, step.meta()))
            self._sent()
        except StageLinkError as e:
            raise self._link_error(e) from e

    def close(self) -> None:
        """STOP to the stages and wait (bounded) for their exit; with a stage down, kill the others."""
        if self._closed:
            return
        self._closed = True  # the watcher stops: the stages exit now
        if self.down is None:
            try:
                self._send(self.books.tick(STOP))
            except StageDown:
                pass
        bad = []
        for p in self.children:
            if self.down is not None:
                p.kill()
                continue
            try:
                rc: int | None = p.wait(EXIT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 (a stage that does not exit in time is killed and named)
                rc = p.kill()
            if rc != 0:
                bad.append(f"{p.name} exited {rc}")
        self.group.close()
        if bad:
            raise StageDown(f"pipeline stages failed: {', '.join(bad)} (their errors are above)")
        if self.down is None and self.children:
            log.info("pipeline stopped: %s exited 0", ", ".join(p.name for p in self.children))


def start_pipeline(
    model_dir: Path,
    ec: EngineConfig,
    pipe: PipelineConfig,
    argv: Sequence[str],
    ranks: Ranks | None = None,
    dp: bool = False,
) -> Any:
    """Stage 0 (this command as the user started it): start stages 1..N-1 as copies of `dsakv *argv` and return
    the PipelinedEngine. A stage process (DSAKV_PP_RANK set): run the stage until stage 0 stops it and return
    its exit code (an int). `ranks`: this process's TP group (of its stage; a TP rank r > 0 of stage 0 returns a
    PipelinedEngine that sends nothing, pipeline/tp_stage.py) or, with `dp` (DP attention), its stage's EP group:
    every DP rank's stage 0 starts its own stages (pipeline/dp_stage.py)."""
    check_refusal(ec, pipe.pp_size)
    split_layers(ModelSpec.from_path(model_dir).num_layers, pipe.pp_size, pipe.partition)  # a bad partition: now
    env_rank = os.environ.get(PP_RANK_ENV)
    if env_rank is not None:
        if int(os.environ.get(SIZE_ENV, pipe.pp_size)) != pipe.pp_size:
            raise ConfigError(f"this stage was started for {os.environ[SIZE_ENV]} stages, not --pp-size {pipe.pp_size}")
        return run_stage(int(env_rank), int(os.environ[PORT_ENV]), model_dir, ec, pipe, ranks, dp)
    if ranks is not None and not ranks.lead and not dp:  # a TP rank of stage 0: stage 0's rank 0 started the stages
        return PipelinedEngine(model_dir, ec, pipe, 0, [], ranks)
    port = free_ports(1)
    children = []
    for k in range(1, pipe.pp_size):
        env = {**os.environ, **CHILD_ENV, PP_RANK_ENV: str(k), PORT_ENV: str(port), SIZE_ENV: str(pipe.pp_size)}
        name = f"pipeline stage {k}"
        if dp and ranks is not None:  # (d, k) joins stage k's EP group as rank d
            env |= stage_env(k, ranks)
            name = f"dp rank {ranks.rank} {name}"
        children.append(Proc(name, dsakv_cmd(*argv), env=env, new_session=False).start())
    try:
        return PipelinedEngine(model_dir, ec, pipe, port, children, ranks, dp)
    except BaseException:
        for p in children:
            p.kill()
        raise


def run_stage(
    rank: int,
    port: int,
    model_dir: Path,
    ec: EngineConfig,
    pipe: PipelineConfig,
    ranks: Ranks | None = None,
    dp: bool = False,
) -> int:
    """Stage `rank` > 0: its layers' pool, the group, then StageFollower steps until STOP (0) or a broken link (1).
    With `dp`: `ranks` is the stage's EP group (a dead peer named by guard_stage, pipeline/dp_stage.py)."""
    from dsakv.cache.device_pool import DevicePool
    from dsakv.pipeline.follower import StageFollower
    from dsakv.pipeline.page_mirror import PageMirror

    if not 0 < rank < pipe.pp_size:
        raise ConfigError(f"{PP_RANK_ENV}={rank} must be in 1..{pipe.pp_size - 1} (--pp-size {pipe.pp_size})")
    spec, model = _load(model_dir, ec, ranks, dp)
    layouts, pages = stage_shape(ec, spec, pipe)
    pool = DevicePool(layouts[rank], pages, device=model.device)
    if dp and ranks is not None:
        guard_stage(model, ranks, rank)
    group = make_group(
        rank, pipe.pp_size, port, pipe.stage_timeout, model.dtype, spec.hidden_size, None if dp else ranks
    )
    end = time.monotonic() + STARTUP_S
    while not group.form({"pid": os.getpid(), "pages": pages}):
        if time.monotonic() > end:
            log.error("pipeline stage %d: stage 0 did not form the pipeline within %g s", rank, STARTUP_S)
            return 1
    log.info("pipeline stage %d/%d: layers %s, %d pages", rank, pipe.pp_size, layouts[rank].describe_range(), pages)
    follower: StageFollower[Any] = StageFollower(
        group, model, pool, PageMirror(pages, f"pipeline stage {rank} pool"), IDLE_WAIT_S
    )
    while True:
        try:
            kind = follower.iteration()
        except (StageLinkError, RankDown) as e:  # RankDown: a TP rank died under this stage's model step
            log.error("pipeline stage %d: %s: exiting (stage 0 fails what was in flight)", rank, e)
            if isinstance(e, RankDown):
                group.note_down(str(e))
            group.close()
            return 1
        if kind == STOP:
            group.close()
            return 0


IDLE_WAIT_S = 24 * 3600.0  # a stage waits this long for stage 0's next message (stage 0 ticks while idle; its
# death closes the link at once, and stage 0's exit sends this process its parent-death signal)
