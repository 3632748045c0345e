"""Per-tenant limits, optionally narrowed per key: requests and tokens a minute, concurrency, a monthly budget."""
