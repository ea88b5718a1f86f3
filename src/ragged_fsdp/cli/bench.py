"""`bench`: ragged_fsdp beside torch FSDP2, FSDP1 and DDP (see ragged_fsdp.bench.engine)."""
from ..bench.engine import add_parser, main as run  # noqa: F401
