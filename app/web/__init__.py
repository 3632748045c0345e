"""HTTP plumbing every route shares: errors in OpenAI's shape and their handlers, strict JSON bodies, the cap on
request bodies, request ids, client disconnects. It imports nothing else of the app, so any package may use it.
"""
