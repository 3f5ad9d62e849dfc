"""Statistics and reports of stage outputs: `csd-pipeline inspect` tables and `csd-pipeline report`."""

# Teacher rows read per teacher output for the mass on explicit events: about 20k to 50k chunks, enough
# for the distribution and seconds to enumerate (the events are built in Python, chunk by chunk).
TEACHER_ROWS = 200
