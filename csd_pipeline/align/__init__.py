"""Stage 2: corpus readers, chunk alignment, text and chat mode, the align stage."""
