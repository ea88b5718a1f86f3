"""torch FSDP2's surface on ragged_fsdp modules: its module class and ``fully_shard.state``,
the extension points (forward methods, comm hooks), and parameters whose tensor subclass
brings its own all-gather."""
