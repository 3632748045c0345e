"""Speculative decoding: when a step carries proposals, n-gram prompt lookup, verifying what was proposed."""
