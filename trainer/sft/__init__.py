"""Supervised fine-tuning on recorded sessions (`rlproxy train --objective sft`): `samples`
(sessions -> the assistant turns as the student's template writes them), `step` (the NLL
step), `run` (the snapshot, epochs and steps)."""
