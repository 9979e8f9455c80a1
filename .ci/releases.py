"""CI, at its start: the newest release of each package the project's range is about, on the
package index, against the range `pyproject.toml` declares and the release CI's newest
environment tests. A release outside the range prints a warning: CI never fails on a release
day by itself.

    python .ci/releases.py torch==2.15.0     # the newest environment's own pins

Exits 0 whatever it finds (an index that does not answer included).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare Python: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

#: The packages whose range the project declares and tests at both ends.
PACKAGES = ("torch", "pytorch-lightning", "lightning", "ray")


def declared_ranges(pyproject: Path) -> dict[str, SpecifierSet]:
    """Each package's range as `pyproject.toml` declares it (dependencies and extras)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    ranges: dict[str, SpecifierSet] = {}
    for line in lines:
        requirement = Requirement(line)
        if requirement.name in PACKAGES and requirement.specifier:
            ranges[requirement.name] = requirement.specifier
    return ranges


def index_versions(package: str) -> list[Version] | None:
    """The final releases the index serves for ``package``, or None if it did not answer."""
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "index",
                "versions",
                package,
                "--timeout",
                "10",
                "--retries",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"Available versions: (.+)", done.stdout)
    if found is None:
        return None
    versions = []
    for text in found[1].split(","):
        try:
            version = Version(text.strip())
        except InvalidVersion:
            continue
        if not version.is_prerelease:
            versions.append(version)
    return versions


def verdict(
    package: str, versions: list[Version], declared: SpecifierSet, pins: dict[str, Version]
) -> tuple[Version, Version | None, str]:
    """The newest release, the one CI's newest environment tests (a pin, else the newest the
    range admits) and what to say of them."""
    newest = max(versions)
    tested = pins.get(package) or max((v for v in versions if v in declared), default=None)
    if newest not in declared:
        return (
            newest,
            tested,
            (
                f"WARNING: {package} {newest} is out and outside the declared range "
                f"{package}{declared}: try it (the compat tests), then widen the range and move "
                "CI's newest environment to it"
            ),
        )
    if tested is not None and tested < newest:
        return (
            newest,
            tested,
            (
                f"WARNING: {package} {newest} is inside the range but CI's newest environment "
                f"tests {tested}: move its pin"
            ),
        )
    return newest, tested, "ok"


def main(argv: list[str]) -> int:
    pins = {}
    for arg in argv:
        requirement = Requirement(arg)
        pinned = [s.version for s in requirement.specifier if s.operator == "=="]
        if pinned:
            pins[requirement.name] = Version(pinned[0])
    ranges = declared_ranges(Path(__file__).resolve().parent.parent / "pyproject.toml")
    print("Newest releases on the package index, against what CI's newest environment tests:")
    for package in PACKAGES:
        declared = ranges.get(package, SpecifierSet())
        versions = index_versions(package)
        if not versions:
            print(f"  {package:<18} the index did not answer: not checked")
            continue
        newest, tested, said = verdict(package, versions, declared, pins)
        shown = "-" if tested is None else str(tested)
        print(
            f"  {package:<18} newest {newest!s:<9} tested {shown:<9} "
            f"declared {declared!s:<14} {said}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
