"""A checkpoint that saves with no coordinator and still loads at any world size.

    from ragged_fsdp.checkpoint import save_local, load_local

    save_local(model.state_dict(), "ckpt/step-1000")      # every rank
    load_local(model.state_dict(), "ckpt/step-1000")      # any world size, in place

``dcp.save`` gathers every rank's plan on a coordinator, builds the global metadata and
scatters it back: O(W x tensors) objects on one rank. Here each rank writes two files into
the (shared) directory, and the ranks exchange only a few integers (all-reduces, below):

* ``part-{r}-of-{W}.pt``: its local pieces (``torch.save``; a RaggedShard DTensor as its flat
  local run; a plain tensor only from rank 0 when it is equal on every rank, from every rank
  when it is not), plus a header: the save id, rank, W and a CRC-32 per stored tensor;
* ``part-{r}-of-{W}.meta``: what they are: per key the global shape, dtype and, for
  RaggedShard values, the layout as runs of equal per-rank counts (``local_layout.RunLayout``),
  a few numbers per tensor whatever W is; the plain Python values; the save id. It is
  ``torch.save`` bytes behind one header line carrying their length and CRC-32, so a
  truncated, edited or foreign ``.meta`` is refused before it is unpickled.

Nested state (``{"model": model.state_dict(), "optim": opt.state_dict()}``) is flattened into
DCP's dotted keys (``optim.state.0.exp_avg``), so every DTensor inside it is stored by the
rank that holds it.

Agreement. A save costs four all-reduces of a few int64s (no gather, nothing O(W) on any
rank; ``ragged_fsdp.agreement``): before writing, the ranks agree that every rank could
prepare its part, that they name one directory (resolved; a different one per rank is refused
on every rank), that the directory holds no part of another save (if any rank sees one, every
rank refuses: two saves never mix and nothing is overwritten; then rank 0 takes the
directory's lock, as ``checkpoint.save`` takes its root's, looks again and holds it until every
rank wrote, so a second job saving there is refused too), on the keys, on which plain values are equal on every
rank, and on a random save id from rank 0; after writing, that every rank wrote its part (if
one failed, every rank removes its own files and raises). A load costs one all-reduce: every
rank first checks what it will read (the ``.meta`` headers, the save id in every part it reads
and in every ``.meta`` assigned to it, the CRC-32 of every stored tensor it reads from) and
only if every rank found everything sound does any rank copy anything; otherwise every rank
raises the first failing rank's error, naming the file and the saved rank.

Each file is written to a temporary name and renamed, the ``.meta`` after the ``.pt``, so a
part is either there whole or not at all, and a save counts as complete only when all W
``.meta`` files are there: a save interrupted on any rank never looks complete (``load_local``
names the missing parts).

Loading reads one ``.meta`` in full (every part describes every RaggedShard layout) and then
only the ``.pt`` files of the saved ranks whose pieces overlap what this rank holds, memory
mapped, copying element ranges straight into the local shards. Bitwise: no dtype conversion
(a dtype or shape mismatch is an error naming the key). A stored tensor is checked whole, so
a rank that needs part of a saved rank's piece reads all of it (as DCP's reader does).

Scope: values that are RaggedShard DTensors on a 1-D mesh over every rank (what
``fully_shard`` makes for FSDP), plain tensors and plain Python values, nested in dicts and
lists. Other DTensors (HSDP, TP, FSDP2's ``Shard(0)``) are refused by name: use
``ragged_fsdp.checkpoint.save`` (DCP) for those. Plain values that differ per rank load only
at the saving world size.

Where each concern lives (this module re-exports their public names): the format, headers,
errors and the agreement in :mod:`.local_format`; the state dict's walk in :mod:`.local_tree`;
writing in :mod:`.local_write`; checked reading in :mod:`.local_read`; loading and the
one-process views in :mod:`.local_load`.
"""

from __future__ import annotations

from .local_format import FORMAT, HEADER_KEY, LocalCheckpointCorruptError, LocalCheckpointError
from .local_load import describe_local, load_local, read_local_full
from .local_read import is_local_save, local_parts, read_meta
from .local_write import part_meta, save_local

__all__ = ["save_local", "load_local", "local_parts", "LocalCheckpointError", "LocalCheckpointCorruptError",
           "part_meta", "is_local_save", "describe_local", "read_local_full", "read_meta", "FORMAT", "HEADER_KEY"]
