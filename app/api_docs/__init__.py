"""The API's OpenAPI schema as served at ``/schema``: what Litestar derives from the routes, completed with
the request bodies as msgspec decodes them, the event streams, the CSV export and examples. It describes
every package's routes, so it sits above them with the app factory, not in app/web/.
"""
