"""Training settings that shape the cost: batch sizes, precision, optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainingSpec(BaseModel):
    """What the search plans for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch_size: int = Field(gt=0, description="Samples per optimizer step.")
    micro_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8], min_length=1,
        description="Candidate pipeline micro-batch sizes (samples per micro-batch, before a stage's DP split).",
    )
    precision: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Compute and parameter dtype.")
    optimizer: Literal["adam"] = Field("adam", description="Optimizer (Adam: fp32 master weights, m and v).")
    distributed_optimizer: bool = Field(False, description="Shard optimizer states over each stage's DP group.")
    attention: Literal["auto", "flash", "unfused"] = Field(
        "auto", description="Attention kernel the analytic model assumes: flash (transformer-engine's fused attention "
        "in the runtime), unfused (megatron-core's local attention: s^2 activations, no transformer-engine), or auto "
        "(flash on GPUs that have it: A100, H100, H200).")

    @model_validator(mode="after")
    def _check(self) -> "TrainingSpec":
        for m in self.micro_batch_sizes:
            if m < 1:
                raise ValueError(f"micro_batch_sizes: {m} is not a positive integer")
        usable = [m for m in self.micro_batch_sizes if self.global_batch_size % m == 0]
        if not usable:
            raise ValueError(
                f"micro_batch_sizes: none of {self.micro_batch_sizes} divides global_batch_size "
                f"({self.global_batch_size}); add a divisor"
            )
        return self
