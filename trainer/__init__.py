"""GRPO trainer: data from the store, advantages, packing, losses, backends, worker.

Deliberately empty of imports: `import trainer.advantages` must not pull in torch.
"""
