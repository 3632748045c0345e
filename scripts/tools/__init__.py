"""Tools: the demo adapters' training, the console's vendored JavaScript, the Triton AOT compile report."""
