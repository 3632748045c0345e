"""What operators watch: Prometheus metrics by tenant and adapter, log lines with request ids, and the
``/health``, ``/ready`` and ``/metrics`` routes.
"""
