"""Stage 3: the teacher forward, the teacher-logits stage (config, stage, shard writer) and the teacher store
(`store/`: schema, codec, writer, selectors and `TeacherTopkOutput`, the one reader of its outputs)."""
