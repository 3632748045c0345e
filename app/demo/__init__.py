"""The first start's demo, so one command shows it all: the demo adapters (trained once) and a demo tenant
with an inference key that the start banner prints.
"""
