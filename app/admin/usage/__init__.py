"""The usage report for billing: the daily rollup per tenant and adapter, as JSON or CSV."""
