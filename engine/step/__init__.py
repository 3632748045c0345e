"""One engine step: its metadata built once, the forward pass and sampling run, its results applied."""
