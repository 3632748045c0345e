"""The admin console: server-rendered pages at /console over the same services as the admin REST API."""
