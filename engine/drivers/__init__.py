"""What drives an engine: the shared step loop, the asyncio engine, the worker fed by a process or a Ray replica."""
