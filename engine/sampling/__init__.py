"""Choosing tokens: sampling rules as tensors over a step's rows, logprobs, structured output's grammars and masks."""
