"""rlproxy gateway: an OpenAI-compatible service that records every call for RL training."""


def version() -> str:
    """The installed rlproxy's version (`rlproxy --version`): its package metadata, which pip wrote
    from pyproject.toml."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rlproxy")
    except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
        return "unknown (not installed: pip install -e .)"
