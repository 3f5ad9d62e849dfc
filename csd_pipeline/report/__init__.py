"""Statistics and reports of stage outputs: `csd-pipeline inspect` tables and `csd-pipeline report`."""
