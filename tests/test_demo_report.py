"""The demo's table and notes (``ragged_fsdp.train.report``): the loss column is the mean and
sample standard deviation of the last 50 steps, and the notes under it explain the loss gap
and the memory ratio from the run's own numbers. Pure: no ranks."""
import math

from ragged_fsdp.train import LAST_N, loss_summary, notes


def test_loss_summary_is_mean_and_sd_of_the_last_steps():
    losses = [10.0] * 7 + [1.0, 2.0, 3.0, 4.0]
    mean, sd, n = loss_summary(losses, 4)
    assert (mean, n) == (2.5, 4)
    assert math.isclose(sd, math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3))
    assert loss_summary([3.0], 50) == (3.0, 0.0, 1)
    assert LAST_N == 50


def test_notes_explain_loss_and_memory():
    runs = [{"framework": "ragged_fsdp", "losses": [5.0] + [1.0, 1.2] * 30, "peak_tracked_bytes": 50 * 2**20,
             "block_param_bytes": 2**20, "model_param_bytes": 4 * 2**20},
            {"framework": "fsdp2", "losses": [5.0] + [1.1, 1.1] * 30}]
    text = "\n".join(notes(runs))
    assert "differ by 0.0000" in text and "last 50 steps" in text  # both means are 1.1
    assert "4.00 MiB in all" in text and "one block 1.00 MiB" in text and "50.0 MiB" in text
    assert "0.905x" in text
