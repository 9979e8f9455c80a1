"""CI's release check (.ci/releases.py): pure logic over version lists, no index asked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

_PATH = Path(__file__).resolve().parent.parent / ".ci" / "releases.py"
_spec = importlib.util.spec_from_file_location("ci_releases", _PATH)
assert _spec is not None and _spec.loader is not None
releases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(releases)


def _versions(*texts: str) -> list[Version]:
    return [Version(t) for t in texts]


def test_the_declared_ranges_admit_the_newest_environment_of_ci():
    ranges = releases.declared_ranges(_PATH.parent.parent / "pyproject.toml")
    assert set(ranges) == set(releases.PACKAGES)
    assert Version("2.15.0") in ranges["torch"]
    assert Version("2.6.0") in ranges["torch"]  # the oldest environment's


def test_a_release_outside_the_range_is_a_warning_naming_it():
    declared = SpecifierSet(">=2.6,<2.16")
    newest, tested, said = releases.verdict("torch", _versions("2.15.0", "2.16.0"), declared, {})
    assert (newest, tested) == (Version("2.16.0"), Version("2.15.0"))
    assert said.startswith("WARNING: torch 2.16.0 is out and outside the declared range")


def test_a_release_inside_the_range_but_not_pinned_is_a_warning():
    declared = SpecifierSet(">=2.6,<2.16")
    pins = {"torch": Version("2.14.1")}
    _, tested, said = releases.verdict("torch", _versions("2.14.1", "2.15.0"), declared, pins)
    assert tested == Version("2.14.1")
    assert "tests 2.14.1: move its pin" in said


def test_the_newest_release_tested_is_ok():
    declared = SpecifierSet(">=2.52,<2.61")
    assert releases.verdict("ray", _versions("2.52.0", "2.60.0"), declared, {})[2] == "ok"


def test_index_versions_reads_pips_listing_without_prereleases(monkeypatch):
    class Done:
        stdout = "ray (2.60.0)\nAvailable versions: 2.61.0rc1, 2.60.0, 2.59.0, garbage\n"

    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: Done())
    assert releases.index_versions("ray") == _versions("2.60.0", "2.59.0")
