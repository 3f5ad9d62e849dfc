"""What the losses read, prepared on the CPU (numpy) in the data-loader workers: CSD events per chunk, the per-chunk rows of the baseline losses and of ALM, per-chunk teacher selection."""
