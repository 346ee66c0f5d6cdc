"""The policy role: `PolicyTrainer` (trainer.py: KL reference, the step loop on the role
skeleton), the step's update (update.py), its loss and batch (loss.py: `policy_loss_func`,
`PolicyBatch`) and weight publishing for inference (publish/: `WeightPublisher`,
`make_publisher`; one module per path)."""
