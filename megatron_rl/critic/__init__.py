"""The critic: batched scoring across critic ranks (the HTTP service and training loop are not
built yet)."""
