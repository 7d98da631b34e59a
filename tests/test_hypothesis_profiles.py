"""The hypothesis profiles of tests/conftest.py: 'ci' (CI=true) draws the same examples on every
run, 'dev' draws new ones."""

from hypothesis import given, settings, strategies as st
from conftest import hypothesis_profile


def draws(profile: str) -> list:
    seen = []

    @settings(settings.get_profile(profile), max_examples=25)
    @given(st.lists(st.integers(), max_size=5), st.text(max_size=5))
    def record(xs, s):
        seen.append((xs, s))

    record()
    return seen


def test_ci_profile_is_derandomized_and_prints_the_blob():
    ci = settings.get_profile("ci")
    assert (
        ci.derandomize
        and ci.database is None
        and ci.print_blob
        and ci.deadline is None
        and ci.max_examples == 50
    )
    assert settings.get_profile("dev").print_blob and not settings.get_profile("dev").derandomize


def test_ci_profile_draws_the_same_examples_twice():
    first = draws("ci")
    assert len(first) == 25 and draws("ci") == first


def test_dev_profile_draws_new_examples():
    assert draws("dev") != draws("dev")


def test_profile_choice(monkeypatch):
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    monkeypatch.setenv("CI", "true")
    assert hypothesis_profile() == "ci"
    monkeypatch.setenv("CI", "")
    assert hypothesis_profile() == "dev"
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    assert hypothesis_profile() == "ci"
