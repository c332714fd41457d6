"""The fault tier's shared settings (tests/fault's conftest and tests import them here)."""

GAP_SECONDS = 2
"""The fault server's --seq-gap-timeout: short, so that the gaps a campaign leaves close quickly."""

