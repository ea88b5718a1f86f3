"""torch FSDP2's surface on ragged_fsdp modules: its module class and ``fully_shard.state``,
the checks on what the extension setters are given (forward methods, comm hooks), and the
protocol of parameters whose tensor subclass brings its own all-gather. A layer below
``core/`` (see docs/architecture.md): what it reads of a group is a protocol, and the unit
kind that gathers subclass parameters is ``core/subclass_unit.py``."""
