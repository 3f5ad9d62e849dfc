"""Stage 2: corpus readers, chunk alignment, text and chat mode, the align stage (config, stage,
shard writer) and `AlignedOutput`, the one reader of its outputs."""
