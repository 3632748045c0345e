"""Tenants' adapters: resolving a request's `model` to the base model or one of its tenant's adapters."""
