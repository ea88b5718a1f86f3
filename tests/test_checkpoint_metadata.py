"""``.metadata`` is checked before it is used.

DCP's ``.metadata`` says where every item lies and how big each chunk is; the per-item
CRC-32s live inside it, so they cannot vouch for it. Unchecked, an edited chunk size loads
"successfully" with the last element left at its old value, and single flipped bytes give
silently partial loads or raw unpickling/DCP errors. The writers seal ``.metadata`` with
a SHA-256 written after it is complete, and every reader checks the seal before unpickling.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import ragged_fsdp.checkpoint as ck
from ragged_fsdp.checkpoint import metadata_seal


def _small_checkpoint(root) -> str:
    state = {"w": torch.arange(7.0), "b": torch.arange(12.0).view(3, 4), "step": 3}
    return ck.save(state, root, step=0).path


def _fresh():
    return {"w": torch.full((7,), -1.0), "b": torch.zeros(3, 4), "step": 0}


def test_edited_chunk_size_is_refused(tmp_path):
    path = _small_checkpoint(tmp_path / "r")
    md_path = os.path.join(path, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    (chunk,) = md.state_dict_metadata["w"].chunks
    assert tuple(chunk.sizes) == (7,)
    chunk.sizes = torch.Size([6])  # the edit of the issue: the last element is not read
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    state = _fresh()
    with pytest.raises(ck.CheckpointCorruptError) as e:
        ck.load_latest(tmp_path / "r", state)
    msg = str(e.value)
    assert md_path in msg and "SHA-256" in msg and "nothing was loaded" in msg, msg
    assert torch.equal(state["w"], torch.full((7,), -1.0))  # untouched
    for call in (lambda: ck.read_full(path), lambda: ck.load(_fresh(), path), lambda: ck.load_latest(tmp_path / "r")):
        with pytest.raises(ck.CheckpointCorruptError, match="SHA-256"):
            call()


def _outcome(root, original) -> str:
    state = _fresh()
    try:
        ck.load_latest(root, state)
    except ck.CheckpointCorruptError:
        return "refused"
    except Exception as e:  # a raw error: what the issue counted 112 of
        return f"raw {type(e).__name__}: {str(e)[:200]}"
    same = all(torch.equal(state[k], original[k]) for k in ("w", "b")) and state["step"] == original["step"]
    return "loaded" if same else "silently wrong"


def test_every_flipped_byte_of_metadata_is_refused(tmp_path):
    root = tmp_path / "r"
    path = _small_checkpoint(root)
    original = ck.read_full(path)
    outcomes: dict[str, list[int]] = {}
    for name in (".metadata", metadata_seal.seal_name(".metadata")):
        p = os.path.join(path, name)
        with open(p, "rb") as f:
            good = f.read()
        assert name != ".metadata" or 800 < len(good) < 4000, len(good)
        for i in range(len(good)):
            bad = bytearray(good)
            bad[i] ^= 0xFF
            with open(p, "wb") as f:
                f.write(bad)
            outcomes.setdefault(_outcome(root, original), []).append(i)
        with open(p, "wb") as f:
            f.write(good)
        assert _outcome(root, original) == "loaded"
    assert set(outcomes) == {"refused"}, {k: v[:10] for k, v in outcomes.items()}


def test_a_lost_seal_is_refused_and_torch_checkpoints_still_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "r"
    path = _small_checkpoint(root)
    os.unlink(os.path.join(path, metadata_seal.seal_name(".metadata")))
    with pytest.raises(ck.CheckpointCorruptError, match="has no .* seal") as e:
        ck.load_latest(root, _fresh())
    assert os.path.join(path, ".metadata") in str(e.value)
    # a previous checkpoint is named as the way out
    ck.save({"w": torch.arange(7.0), "b": torch.arange(12.0).view(3, 4), "step": 3}, root, step=1)
    os.unlink(os.path.join(root, "step-0000000001", metadata_seal.seal_name(".metadata")))
    with pytest.raises(ck.CheckpointCorruptError) as e:
        ck.load_latest(root, _fresh())
    assert f"ragged_fsdp.checkpoint.load(state, '{path}')" in str(e.value), str(e.value)
    # without item CRC-32s too (stripped), save's completion marker still says a seal is due
    md_path = os.path.join(path, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        delattr(info, ck.integrity.CRC_FIELD)
    delattr(md, ck.integrity.SEALED_FIELD)
    with open(md_path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ck.CheckpointCorruptError, match="completion marker records"):
        ck.load(_fresh(), path)
    # written by a ragged_fsdp from before seals (item CRC-32s, no seal, no seal field, no
    # marker): still loads, with a warning that .metadata itself went unchecked
    old = tmp_path / "old"
    dcp.save({"w": torch.arange(7.0)}, storage_writer=ck.integrity.ChecksummedWriter(old), no_dist=True)
    os.unlink(os.path.join(old, metadata_seal.seal_name(".metadata")))
    with open(os.path.join(old, ".metadata"), "rb") as f:
        md = pickle.load(f)
    delattr(md, ck.integrity.SEALED_FIELD)
    with open(os.path.join(old, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    got = {"w": torch.zeros(7)}
    with pytest.warns(UserWarning, match="written before ragged_fsdp sealed"):
        ck.load(got, old)
    assert torch.equal(got["w"], torch.arange(7.0))
    # written by torch's own writer: no seal, no item CRCs; it loads as before
    plain = tmp_path / "plain"
    dcp.save({"w": torch.arange(7.0)}, checkpoint_id=plain, no_dist=True)
    got = {"w": torch.zeros(7)}
    ck.load(got, plain)
    assert torch.equal(got["w"], torch.arange(7.0))


def test_metadata_removed_mid_read_is_not_called_a_lost_seal(tmp_path, monkeypatch):
    path = _small_checkpoint(tmp_path / "r")
    real = metadata_seal.check_seal

    def vanish_then_check(md_path, data, corrupt):
        os.rename(path, str(tmp_path / "moved"))  # after .metadata was read, before its seal
        return real(md_path, data, corrupt)

    monkeypatch.setattr(metadata_seal, "check_seal", vanish_then_check)
    with pytest.raises(FileNotFoundError, match="was removed while it was being read"):
        ck.load(_fresh(), path)
