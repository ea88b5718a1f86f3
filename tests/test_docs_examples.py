"""Every ```python block of the README and the docs runs (see tests/_doc_blocks.py for the markers).

Single-process blocks run here in turn; the W=2 ones share one launch of 2 gloo ranks.
"""

import pytest

from _dist import run_cases
from _doc_blocks import DocCase, all_blocks, run_block

BLOCKS = [b for b in all_blocks() if not b.skip]
LOCAL = [b for b in BLOCKS if b.world is None]
WORLDS = sorted({b.world for b in BLOCKS if b.world is not None})


@pytest.mark.parametrize("block", LOCAL, ids=lambda b: b.id)
def test_example_runs(block):
    run_block(block)


@pytest.fixture(scope="module")
def launched():
    return {w: run_cases(w, [DocCase(b) for b in BLOCKS if b.world == w]) for w in WORLDS}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.world is not None], ids=lambda b: f"{b.id}[W={b.world}]")
def test_example_runs_on_ranks(block, launched):
    err = launched[block.world][f"{DocCase.__module__}.{DocCase(block).__name__}"]
    if err:
        pytest.fail(f"{block.id} on W={block.world}:\n{err}", pytrace=False)


def test_few_blocks_are_skipped():
    """Skipping is for fragments and GPU/cluster code; most examples must run."""
    blocks = all_blocks()
    skipped = [b.id for b in blocks if b.skip]
    assert len(skipped) <= max(3, len(blocks) // 2), f"{len(skipped)} of {len(blocks)} blocks skipped: {skipped}"
