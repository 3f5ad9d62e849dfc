"""The generate stage: the student writes completions for a prompt corpus (`csd-pipeline generate`)."""
