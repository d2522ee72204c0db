"""The hub tests' fixture: the stand-in hub (tests/hub/fake_hub.py)."""

from tests.hub.fake_hub import hub  # noqa: F401
