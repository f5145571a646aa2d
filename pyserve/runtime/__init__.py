"""Model versions and their lifecycle: loading, control, warm-up, readiness, and the schedulers
that run requests on instances."""
