"""The losses (torch): CSD, the baselines, ALM, KD, the chunk weights, the chunked student log-probs, and the loss a run builds once (`training.py`)."""
