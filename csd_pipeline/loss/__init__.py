"""CSD events per chunk (CPU) and the CSD loss (torch)."""
