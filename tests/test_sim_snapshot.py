"""simulate --snapshot-every: the snapshot's bytes and seconds, checked against the formula
written out here from the step model's own per-rank numbers (exact: the same floats)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from ragged_fsdp.cli import main as cli_main
from ragged_fsdp.sim.mesh import parse_mesh
from ragged_fsdp.sim.profiles import get_profile
from ragged_fsdp.sim.simulate import Scenario, simulate
from ragged_fsdp.sim.snapshot import HOST_LINK_BW, snapshot_cost


def _ragged(gpus: int):
    prof = get_profile("h100")
    sc = Scenario("llama3-8b", gpus, prof, parse_mesh(None, gpus), "adamw", "bf16", 4096, 1, "full", None)
    return next(r for r in simulate(sc, ["ragged"])), prof


def test_snapshot_bytes_and_time_from_the_shard():
    r, prof = _ragged(1024)
    c = snapshot_cost(r, prof, every=2)
    shard = r.sharded_params + r.optimizer_states  # fp32 params + AdamW's two moments
    assert c["bytes_per_rank"] == shard
    assert c["host_bytes_per_node"] == 2 * shard * prof.gpus_per_node  # own part + a peer's copy
    assert c["per_step_s"] == pytest.approx((shard / HOST_LINK_BW + shard / prof.net_bw) / 2, rel=1e-12)
    assert c["step_fraction"] == pytest.approx(c["per_step_s"] / r.step_s, rel=1e-12)
    # at 16x the ranks each holds ~1/16 of the state: the snapshot shrinks, the step does not
    r16, _ = _ragged(16384)
    assert snapshot_cost(r16, prof, 1)["bytes_per_rank"] < c["bytes_per_rank"] / 8


def test_snapshot_every_is_checked_and_printed():
    r, prof = _ragged(1024)
    with pytest.raises(ValueError, match="--snapshot-every 0"):
        snapshot_cost(r, prof, 0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "1024", "--snapshot-every", "0"]) == 2
    assert "--snapshot-every 0" in err.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "1024", "--frameworks", "ragged",
                         "--snapshot-every", "4", "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert doc["snapshot"]["ragged"]["every"] == 4
