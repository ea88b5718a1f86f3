"""`bench`: ragged_fsdp vs torch FSDP2 side by side (see ragged_fsdp.bench.engine)."""
from ..bench.engine import add_parser, main as run  # noqa: F401
