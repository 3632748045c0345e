"""API keys: how they look, how they are stored (a keyed hash, never the plaintext), and how a request's
``Authorization`` header becomes a :class:`~app.keys.authenticator.Principal` without a database query
on most requests.
"""
