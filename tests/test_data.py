"""The demo's data: the same global batch at every world size, and clear errors."""
import pytest
import torch

from ragged_fsdp.data import Batches, default_corpus, load_tokens


def test_local_batches_tile_the_global_batch():
    b = Batches(load_tokens(), seq_len=32, global_batch=12, seed=3)
    x, y = b.global_batch_at(7)
    assert x.shape == (12, 32) and torch.equal(x[:, 1:], y[:, :-1])
    for world in (1, 2, 3, 4):
        parts = [b.local_batch_at(7, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert not torch.equal(b.global_batch_at(8)[0], x)


def test_corpus_is_deterministic_and_text_files_load(tmp_path):
    assert default_corpus(50) == default_corpus(50)
    f = tmp_path / "t.txt"
    f.write_text("hello world\n" * 200)
    assert load_tokens(str(f)).numel() == 2400
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 1 KiB"):
        load_tokens(str(f))
    with pytest.raises(ValueError, match="multiple of the world size"):
        Batches(load_tokens(), 8, 10).local_batch_at(0, 0, 4)
