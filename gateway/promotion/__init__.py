"""Promotion: when a trained step serves as NAME. `serving` (NAME follows the store's serving
step), `rule` (the canary's decision rule, pure), `canary` (`--promote canary`: routing a share
of sessions to the candidate, deciding, watching for a drop)."""
