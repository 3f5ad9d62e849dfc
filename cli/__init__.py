"""Command-line entry points (`csd-pipeline`)."""
