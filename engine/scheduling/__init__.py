"""Which sequences run each step: the sequences, the waiting queue's policy, what a request may ask, the scheduler."""
