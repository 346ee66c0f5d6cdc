"""The policy role: `PolicyTrainer` (trainer.py: loss, KL reference, the step loop on the role
skeleton) and weight publishing for inference (publish/: `WeightPublisher`, `make_publisher`;
one module per path)."""
