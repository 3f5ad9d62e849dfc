"""Stage 3: the teacher forward, its top-k codec, the teacher-logits stage and the teacher top-k reader."""
