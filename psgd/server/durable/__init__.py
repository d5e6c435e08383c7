"""What keeps a shard through a crash: what of it goes into its checkpoints and how it comes back from them, going
back to a cut, and a shard kept twice (a primary, its replica, the stream between them, what one asks the other)."""
