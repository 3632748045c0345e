"""Usage metering: what each request consumed, written to ``usage_events`` off the request path."""
