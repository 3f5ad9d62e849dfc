"""Stage 3: the teacher forward, its top-k codec, the teacher-logits stage (config, stage, shard
writer) and `TeacherTopkOutput`, the one reader of its outputs."""
