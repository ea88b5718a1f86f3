"""The engine's small shared vocabulary: where a group's parameters are and where its step is."""

from __future__ import annotations

import enum

__all__ = ["ShardedState", "TrainingState"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"
    # reshard_after_forward=k: each rank keeps 1/k of the unsharded buffer after forward;
    # the backward all-gather runs within the k ranks of its node
    SHARDED_POST_FORWARD = "sharded_post_forward"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
