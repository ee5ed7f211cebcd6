"""The trainer on several processes (`--nproc`, torchrun): `team` (the process group, rank 0 leads),
`split` (rows to ranks by tokens), `wrap` (DDP or FSDP2, the state gathered whole), `memory` (what
fits a device)."""
