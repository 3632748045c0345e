"""The gateway's side of the engine: the EngineClient interface, and its clients of an engine on a thread of
this process or in a worker process of its own (the Ray client, in app/cluster/, is the third). Each keeps the
tokenizer here, so an engine is sent token ids and never sees a text prompt.
"""
