"""The streaming CSD trainer (`csd-train`)."""
