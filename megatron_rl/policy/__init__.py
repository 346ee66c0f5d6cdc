"""The policy role: `PolicyTrainer` (trainer.py: loss, KL reference, the step loop on the role
skeleton) and weight publishing for inference (publish.py: `WeightPublisher`, `make_publisher`)."""
