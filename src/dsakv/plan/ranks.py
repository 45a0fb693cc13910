"""The rank grid of one worker instance: PP stages x DP ranks x attention-TP ranks, and the MoE's EP split.

    --tp T --dp D --enable-dp-attention       T GPUs per stage; D attention groups of T/D ranks each
    --tp T --dp D (no DP attention)           D replicas of T GPUs per stage
    --ep E                                    routed experts split over E ranks of the T-rank MoE group,
                                              each expert tensor-parallel over T/E of them

              stage 0                              stage 1
    DP 0: [tp 0 .. tp T/D-1]  one pool      DP 0: [...]   one pool
    DP 1: [tp 0 .. tp T/D-1]  one pool      DP 1: [...]   one pool

What each rank holds (the production engines' rule, issue 23): the MLA latent KV and the index-K are
replicated on every attention-TP rank, never split by head, so every rank of a DP group holds the full keys of
its stage's layers for that group's requests; each DP group has its own pool and its own requests. Tokens per
rank are therefore the single-GPU figure of the stage's layout, and an instance holds `pools` times that.

Weights per rank: q_a / kv_a projections, norms and the whole indexer replicated; q_b (or q), kv_b and o_proj
split over the attention-TP ranks; dense MLP and shared experts over the attention-TP ranks (the engine's
choice: no gather across DP groups for dense layers); routed experts over all T ranks of the MoE group (E-way
expert parallel x T/E-way tensor parallel); embeddings and the LM head vocab-parallel over the attention-TP
ranks. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsakv.errors import ConfigError
from dsakv.spec.model import ModelSpec


@dataclass(frozen=True)
class RankGrid:
    """The ranks of one worker instance; validated here, checked against a model with `check_model`."""

    tp: int = 1
    dp: int = 1
    dp_attention: bool = False
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, v in (("--tp", self.tp), ("--dp", self.dp), ("--ep", self.ep), ("--pp", self.pp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} {v!r} must be an integer >= 1")
        if self.dp_attention:
            if self.dp == 1:
                raise ConfigError("--enable-dp-attention needs --dp > 1 (the number of attention DP groups)")
            if self.tp % self.dp:
                raise ConfigError(
                    f"--tp {self.tp} is not a multiple of --dp {self.dp}: with --enable-dp-attention the {self.tp} "
                    f"ranks of a stage form {self.dp} attention groups of tp/dp ranks each; pick a --dp dividing "
                    f"{self.tp}"
                )
        if self.tp % self.ep:
            raise ConfigError(
                f"--ep {self.ep} does not divide --tp {self.tp}: the MoE runs on the {self.tp} ranks of a stage as "
                f"ep expert groups x tp/ep tensor ranks; pick an --ep dividing {self.tp}"
            )

    @property
    def attention_tp(self) -> int:
        """Ranks that share one DP group's attention (heads split over them, keys replicated on each)."""
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def moe_tp(self) -> int:
        """Tensor-parallel ranks of one expert (the MoE group is ep x moe_tp = tp ranks)."""
        return self.tp // self.ep

    @property
    def pools(self) -> int:
        """Independent KV pools (request sets) per stage: DP groups, or DP replicas without DP attention."""
        return self.dp

    @property
    def ranks_per_stage(self) -> int:
        return self.tp if self.dp_attention else self.tp * self.dp

    @property
    def world_size(self) -> int:
        return self.ranks_per_stage * self.pp

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse a grid the model's heads or experts cannot be split over, naming both numbers."""
        atp = self.attention_tp
        if spec.num_attention_heads % atp:
            raise ConfigError(
                f"{spec.name} has {spec.num_attention_heads} attention heads, not divisible over {atp} attention-TP "
                f"ranks (--tp {self.tp}" + (f" / --dp {self.dp}" if self.dp_attention else "") + "): pick a TP size "
                f"dividing {spec.num_attention_heads}"
            )
        if spec.n_routed_experts and spec.n_routed_experts % self.ep:
            raise ConfigError(
                f"{spec.name} has {spec.n_routed_experts} routed experts, not divisible over --ep {self.ep}: pick an "
                f"--ep dividing {spec.n_routed_experts}"
            )

    def describe(self) -> str:
        if self.dp_attention:
            head = f"tp {self.tp} x dp {self.dp} with DP attention (attention TP {self.attention_tp}, {self.dp} pools)"
        elif self.dp > 1:
            head = f"tp {self.tp} x dp {self.dp} replicas ({self.dp} pools)"
        else:
            head = f"tp {self.tp}"
        return f"{head}, ep {self.ep}, pp {self.pp}: {self.world_size} GPUs"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "dp": self.dp,
            "enable_dp_attention": self.dp_attention,
            "ep": self.ep,
            "pp": self.pp,
            "attention_tp": self.attention_tp,
            "moe_tp": self.moe_tp,
            "pools_per_stage": self.pools,
            "ranks_per_stage": self.ranks_per_stage,
            "world_size": self.world_size,
        }


SINGLE = RankGrid()
