"""scheduler_svc."""
